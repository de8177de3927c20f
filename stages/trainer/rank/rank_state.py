"""A rank's lifecycle: its named states, the moves between them, and what it reports.

A rank (``ReplicaWorker`` and the ``TrainLoop`` in it) moves through ``RankState``s,
and only along ``RANK_TRANSITIONS``: ``RankStatus.enter`` refuses any other move, so a
new path through the loop is a new row here, not a new branch somewhere else. The
driver reads each rank's ``RankReport`` (a frozen snapshot) from its polls, and a rank
looking for a heal source reads its peers' ``PeerProgress``.

A rank's lifecycle state is not a curriculum phase (``PhaseSpan``): a rank in state
``phase_end`` waits at the end of the phase ``RankReport.boundary`` indexes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypedDict, Unpack

from pydantic import BaseModel, ConfigDict, JsonValue

from stages.trainer.parallel.layout import BuiltLayout
from stages.trainer.rank.loss_spike import ReportedSpike


class RankState(StrEnum):
    starting = "starting"  # the process is up, building its model
    standby = "standby"  # a warm spare, waiting to take a lost group's place
    awaiting_data = "awaiting_data"  # joined its group; the run's data is not ready yet
    ready = "ready"  # has its data; waits for the driver's "go" (one first quorum)
    training = "training"
    phase_end = "phase_end"  # closed a curriculum phase; waits at its gate
    paused = "paused"  # a loss spike; waits for the human's decision
    held = "held"  # stopped at the step every group agreed on; waits for a resize
    finished = "finished"  # trained every step of the schedule
    stopped = "stopped"  # told to stop before the end
    error = "error"  # the loop raised; the driver fails the run


# Every move a rank makes. ``error`` is reachable from every state (the loop raised);
# a process Ray restarts, or a fleet rank handed to the next run, starts over at
# ``starting`` with a new ``RankStatus``.
RANK_TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    RankState.starting: frozenset({RankState.standby, RankState.awaiting_data}),
    RankState.standby: frozenset({RankState.awaiting_data}),  # activated: joins the group
    # ``stopped``: the run was cancelled before its data was ready.
    RankState.awaiting_data: frozenset({RankState.ready, RankState.stopped}),
    RankState.ready: frozenset({RankState.training}),
    RankState.training: frozenset(
        {
            RankState.phase_end,
            RankState.paused,
            RankState.held,
            RankState.finished,
            RankState.stopped,
        }
    ),
    RankState.phase_end: frozenset({RankState.training}),  # the gate's answer came
    RankState.paused: frozenset({RankState.training}),  # the human's decision came
    # The new members came (it trains on), or its group leaves the run (drained).
    RankState.held: frozenset({RankState.training, RankState.stopped}),
    RankState.finished: frozenset(),
    RankState.stopped: frozenset(),
    RankState.error: frozenset(),
}
# States in which a rank's loop has ended (the driver stops waiting on it).
ENDED_STATES = frozenset({RankState.finished, RankState.stopped, RankState.error})


class IllegalTransition(RuntimeError):
    """A rank tried a move ``RANK_TRANSITIONS`` does not list: a bug in the loop."""


class RankReport(BaseModel):
    """What one rank tells the driver at each poll."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int
    # The Ray node this rank's process runs on (hex; "" outside Ray): a resize drains
    # the groups on the nodes its booking took back.
    node_id: str = ""
    # The devices Ray gave this rank (none on cpu, none for a standby).
    gpu_ids: list[str] = []
    state: RankState = RankState.starting
    # Steps this rank's group committed (torchft's Manager), and the quorum's size.
    step: int = 0
    quorum: int | None = None
    # A restarted process (or an activated standby): it heals, no start barrier.
    restarted: bool = False
    started_at: float = 0.0
    # The replica group a standby was activated into.
    group: int | None = None
    # The curriculum phase the loop is in, and the one it closed and waits at.
    phase_name: str | None = None
    boundary: int | None = None
    # The layout the rank built, read back from its mesh (``parallelize``).
    layout: BuiltLayout | None = None
    # The parameter digest at a pause or at the end.
    digest: str | None = None
    # The loss spike it paused for (with its batch and the skipped data windows),
    # and the step it paused at.
    spike: ReportedSpike | None = None
    paused_at: int | None = None
    # The step every group stopped at for a resize (``held``).
    held_at: int | None = None
    error: str | None = None
    traceback: str | None = None


class PeerProgress(BaseModel):
    """Where a rank is, as a restarting peer reads it to pick a heal source."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    group: int
    rank: int
    state: RankState
    step: int


@dataclass(frozen=True)
class RankPoll:
    """One poll's answer: the events the rank buffered since the last one (JSON), and
    its report."""

    events: list[dict[str, JsonValue]]
    report: RankReport


class ReportFields(TypedDict, total=False):
    """What a rank's loop changes in its ``RankReport`` (its ``state`` only through
    ``RankStatus.enter``)."""

    node_id: str
    gpu_ids: list[str]
    step: int
    quorum: int | None
    restarted: bool
    started_at: float
    group: int | None
    phase_name: str | None
    boundary: int | None
    layout: BuiltLayout | None
    digest: str | None
    spike: ReportedSpike | None
    paused_at: int | None
    held_at: int | None
    error: str | None
    traceback: str | None


class RankStatus:
    """A rank's current ``RankReport``, changed by its loop's thread and read by the
    actor's poll: every change swaps in a new frozen report under a lock, so a poll
    never sees half of one (a pause's state without its step)."""

    def __init__(
        self,
        *,
        pid: int,
        gpu_ids: list[str],
        restarted: bool,
        started_at: float,
        node_id: str = "",
    ):
        self._lock = threading.Lock()
        self._report = RankReport(
            pid=pid, node_id=node_id, gpu_ids=gpu_ids, restarted=restarted, started_at=started_at
        )

    @property
    def state(self) -> RankState:
        return self._report.state

    def report(self) -> RankReport:
        return self._report

    def update(self, **fields: Unpack[ReportFields]) -> None:
        """Change what the rank reports, not its state (``enter`` does that)."""
        if "state" in fields:
            raise TypeError("a rank's state changes through enter()")
        _known(fields)
        with self._lock:
            self._report = self._report.model_copy(update=fields)

    def enter(self, state: RankState, **fields: Unpack[ReportFields]) -> None:
        """Move to ``state`` (with the fields that change with it); a move
        ``RANK_TRANSITIONS`` does not list raises ``IllegalTransition``."""
        _known(fields)
        with self._lock:
            current = self._report.state
            if state is not RankState.error and state not in RANK_TRANSITIONS[current]:
                raise IllegalTransition(f"a rank cannot go from {current} to {state}")
            self._report = self._report.model_copy(update={**fields, "state": state})


def _known(fields: Mapping[str, object]) -> None:
    # model_copy(update=...) does not validate: a misspelt field would be carried silently.
    unknown = fields.keys() - RankReport.model_fields.keys()
    if unknown:
        raise TypeError(f"a rank reports no {sorted(unknown)}")
