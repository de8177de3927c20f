"""What the engine keeps per replica group, and what one engine run returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupState:
    """What the driver knows of one replica group, from its rank 0's polls."""

    index: int
    pid: int | None = None
    last_ok: float = 0.0
    lost_at: float | None = None  # set while the group is down
    failed_at: float | None = None  # when the lost process died (recovery.failure_time)
    lost_since_poll_fail: float | None = None
    restarts: int = 0
    phase: str = "starting"
    step: int = 0
    error: str | None = None
    finished: bool = False
    digest: str | None = None
    paused: bool = False
    # The phase index this group closed and waits at (its gate), if any.
    boundary: int | None = None


@dataclass
class EngineResult:
    steps: int
    tokens: int
    final_loss: float | None
    interruptions: int
    checkpoints: list[int]
    final_checkpoint: str | None = None
    proposals: list[str] = field(default_factory=list)
    # Final parameter digest of each group: all equal unless replicas diverged.
    digests: dict[int, str] = field(default_factory=dict)
    # The layout rank 0 of a group built, read back from its mesh (parallelize.py).
    layout: dict[str, Any] = field(default_factory=dict)
    # Final digest of every rank's own shard, keyed "group/rank" (multi-rank groups).
    rank_digests: dict[str, str] = field(default_factory=dict)
    # The phase whose gate failed and stopped the run, if one did.
    stopped_at_phase: int | None = None
