"""What one engine run returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from stages.trainer.parallel.layout import BuiltLayout


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
    # The layout rank 0 of a group built, read back from its mesh (parallelize.py);
    # None if no rank 0 reported one.
    layout: BuiltLayout | None = None
    # Final digest of every rank's own shard, keyed "group/rank" (multi-rank groups).
    rank_digests: dict[str, str] = field(default_factory=dict)
    # The phase whose gate failed and stopped the run, if one did.
    stopped_at_phase: int | None = None
