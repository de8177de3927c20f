"""Events that stages emit while they work.

Stages emit these through ``StageContext.emit``; the run driver buffers them with a
sequence number, and the API server's supervisor persists them. They are the only
thing telemetry is computed from, so each carries wall-clock times, not durations
derived later. No event may carry a secret.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue


def now() -> float:
    return time.time()


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ts: float = Field(default_factory=now)
    stage: str = ""


class LogEvent(_Event):
    kind: Literal["log"] = "log"
    level: Literal["debug", "info", "warning", "error"] = "info"
    message: str


class StepEvent(_Event):
    """One optimizer step of one replica group (rank 0 reports)."""

    kind: Literal["step"] = "step"
    step: int
    replica_group: int = 0
    loss: float
    tokens: int
    seconds: float
    committed: bool
    quorum_size: int = 1
    # The LR, sequence length and curriculum phase the step trained with.
    lr: float | None = None
    seq_len: int | None = None
    phase: str = ""
    # The group's share of the step's global batch: (its place, the member groups)
    # (``stages.trainer.rank.membership``); the run's token ledger is built from these.
    batch_share: tuple[int, int] | None = None
    # Set when a lagging consumer's buffer merged the committed steps first_step..step
    # of this group into this one event (tokens and seconds are their sums).
    first_step: int | None = None


class CheckpointEvent(_Event):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    bytes: int
    blocking_s: float
    total_s: float
    # The curriculum phase the checkpoint belongs to; the one that closes a phase is
    # kept whatever keep-K says.
    phase: str = ""
    closes_phase: bool = False


class InterruptionEvent(_Event):
    """A replica group (or the whole job) was lost and later recovered."""

    kind: Literal["interruption"] = "interruption"
    interruption_kind: Literal[
        "replica_group_lost",
        "all_groups_lost",
        "hang",
        "loss_spike",
        "driver_lost",
        "node_lost",
        "rollout_worker_lost",
    ]
    replica_group: int | None = None
    # When the lost process died, as Ray recorded it (the worker's end time), else the
    # last sign of life the driver saw; None when unknown (e.g. a loss spike).
    failed_at: float | None = None
    detected_at: float
    recovered_at: float | None = None
    detail: str = ""


class FleetEvent(_Event):
    """A change in a run's trainer fleet, as structure: SREs' tools and tests read these
    (a log line beside each is for people). ``checkpoint_restored``: a replica group
    loaded checkpoint ``step`` (at start-up, after every group was lost, or on an
    approved restart that skips the data batches ``skipped_batches`` = [first, end)).
    ``groups_added`` / ``groups_drained``: a resize's groups joined at step ``step`` /
    left after it."""

    kind: Literal["fleet"] = "fleet"
    action: Literal[
        "lighthouse_started",
        "standby_warm",
        "standby_activated",
        "checkpoint_restored",
        "groups_added",
        "groups_drained",
    ]
    replica_group: int | None = None
    # The Ray actors concerned (a standby's ranks, the fleet's trainer actors).
    actors: list[str] = Field(default_factory=list)
    step: int | None = None
    skipped_batches: tuple[int, int] | None = None
    address: str = ""


ResizeAction = Literal["requested", "applied", "refused", "paused"]


class ResizeEvent(_Event):
    """A resize of the run's replica groups (``stages.resize``): ``requested`` when the
    trainer takes the request, ``applied`` at the first committed step with the new
    group count (``seconds``: from the booking change to that step), ``refused`` when
    it cannot be applied (``reason``), ``paused`` when fewer than one group is left."""

    kind: Literal["resize"] = "resize"
    request_id: str
    action: ResizeAction
    groups_before: int
    groups_after: int
    step: int | None = None
    seconds: float | None = None
    reason: str = ""


class ProposalEvent(_Event):
    """A human-gated action, e.g. restart from a checkpoint skipping a data window."""

    kind: Literal["proposal"] = "proposal"
    proposal_id: str
    action: Literal["restart_from_checkpoint"]
    description: str
    params: dict[str, Any] = Field(default_factory=dict)


class PhaseEvent(_Event):
    """Time attribution for goodput: a span of non-productive (badput) work."""

    kind: Literal["phase"] = "phase"
    phase: Literal["startup", "checkpoint_blocking", "recovery", "evaluation", "idle"]
    start: float
    end: float


class ProgressEvent(_Event):
    """Progress of a stage's long work (e.g. data prep over a large corpus): which step,
    how much of it is done, and the estimated seconds left of that step."""

    kind: Literal["progress"] = "progress"
    step: str
    step_index: int = 0
    steps: int = 1
    tasks_done: int = 0
    tasks_total: int = 0
    docs_done: int = 0
    docs_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None


class EvalEvent(_Event):
    """One check of a phase's eval battery: its score and the gate's verdict on it."""

    kind: Literal["eval"] = "eval"
    phase: str
    battery: str
    check: str
    score: float | None
    passed: bool
    reason: str = ""
    min: float | None = None
    max: float | None = None
    max_regression: float | None = None
    previous: float | None = None
    step: int | None = None


class MetricsEvent(_Event):
    """Named gauges of a stage at a step (post-training's rollout fleet and losses)."""

    kind: Literal["metrics"] = "metrics"
    step: int
    scope: str = ""
    values: dict[str, float] = Field(default_factory=dict)


class StageResultEvent(_Event):
    kind: Literal["stage_result"] = "stage_result"
    outcome: dict[str, Any]


Event = Annotated[
    LogEvent
    | StepEvent
    | CheckpointEvent
    | InterruptionEvent
    | FleetEvent
    | ResizeEvent
    | ProposalEvent
    | PhaseEvent
    | ProgressEvent
    | EvalEvent
    | MetricsEvent
    | StageResultEvent,
    Field(discriminator="kind"),
]

# An event serialised (``model_dump(mode="json")``), as it waits in a buffer between a
# rank, the engine and the driver (which numbers it: ``seq``).
EventPayload = dict[str, JsonValue]
