"""Whether each replica group is in the run, and the interruptions its losses make.

The driver sees a group through its ranks' polls and its rank 0's committed steps.
Each group is in one ``GroupHealth``, and moves only on the events below (the table
in docs/training-engine.md); each move is one method of ``GroupSupervisor``:

- ``rank_down``: a rank's poll failed (its process is gone). healthy -> down; the loss
  is detected at the poll, or earlier when torchft already committed a step without the
  group. A warm standby group takes its place (down -> healing at once), or Ray
  restarts its ranks.
- ``rank_answered``: a rank answered. down -> healing (a new process is back); a new
  rank-0 process that was never seen down restarted between two polls:
  healthy -> healing, lost since the new process started.
- ``step_committed``: rank 0 of some group committed a step. A full quorum heals every
  group back in training: healing -> healthy, and one ``InterruptionEvent`` each.
- every group lost at once is the run's interruption: the first step committed after
  it (from the newest complete checkpoint) brings every group back to healthy.

Recovery itself is not driven from here (Ray restarts, torchft heals); this only
observes, and says when a loss began and ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from stages.errors import ErrorCode, ItoError
from stages.events import Event, InterruptionEvent, LogEvent, StepEvent
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.rank.rank_state import RankReport, RankState

RankKey = tuple[int, int]  # (replica group, rank)
InterruptionKind = Literal["replica_group_lost", "all_groups_lost", "loss_spike"]


class GroupHealth(StrEnum):
    healthy = "healthy"  # in the run: no loss open
    down = "down"  # lost, and its ranks' polls fail
    healing = "healing"  # lost, and a process answers again: not yet in a full quorum


# The moves ``GroupSupervisor`` makes (the run-wide "every group lost" recovery moves
# every group, down ones included, back to healthy).
GROUP_TRANSITIONS: dict[GroupHealth, frozenset[GroupHealth]] = {
    GroupHealth.healthy: frozenset({GroupHealth.down, GroupHealth.healing}),
    GroupHealth.down: frozenset({GroupHealth.healing, GroupHealth.healthy}),
    GroupHealth.healing: frozenset({GroupHealth.down, GroupHealth.healthy}),
}


@dataclass
class GroupState:
    """What the driver knows of one replica group, from its ranks' polls."""

    index: int
    pid: int | None = None  # its rank 0's process
    last_ok: float = 0.0
    lost_at: float | None = None  # set while a loss is open
    failed_at: float | None = None  # when the lost process died (recovery.failure_time)
    lost_since_poll_fail: float | None = None  # set while its polls fail
    restarts: int = 0
    state: RankState = RankState.starting  # its rank 0's
    step: int = 0
    error: str | None = None
    finished: bool = False
    digest: str | None = None
    paused: bool = False
    # The phase index this group closed and waits at (its gate), if any.
    boundary: int | None = None

    @property
    def health(self) -> GroupHealth:
        if self.lost_at is None:
            return GroupHealth.healthy
        return GroupHealth.down if self.lost_since_poll_fail is not None else GroupHealth.healing


class GroupSupervisor:
    """Every replica group's health, moved by the driver's polls and its events.

    ``replace`` puts a warm standby group in a lost group's place (False: none is
    warm); ``restart`` has Ray restart a multi-rank group's other ranks;
    ``failure_time`` / ``failure_times`` ask Ray when processes ended
    (``stages.trainer.fleet.recovery``)."""

    def __init__(
        self,
        groups: int,
        *,
        ranks_per_group: int,
        ft: FaultToleranceConfig,
        emit: Callable[[Event], None],
        replace: Callable[[RankKey], bool],
        restart: Callable[[RankKey], None],
        failure_time: Callable[[int | None], float | None],
        failure_times: Callable[[list[int]], dict[int, float]],
    ):
        # The run's groups by index: a resize adds new indices and removes leaving ones.
        self.groups = {g: GroupState(g) for g in range(groups)}
        self.ranks_per_group = ranks_per_group
        self.ft = ft
        self.emit = emit
        self.replace = replace
        self.restart = restart
        self.failure_time = failure_time
        self.failure_times = failure_times
        self.interruptions = 0
        # The first step torchft committed in a smaller quorum while no group was known
        # lost: the loss's detection, when a poll confirms it.
        self._shrunk_at: float | None = None
        self._all_lost_at: float | None = None
        # Each rank's process id and last answered poll: when it is lost, when it died.
        self.pids: dict[RankKey, int] = {}
        self._last_seen: dict[RankKey, float] = {}
        # Each rank's last answer (the one record of it the driver keeps), and when
        # every group's rank 0 first said finished.
        self.reports: dict[RankKey, RankReport] = {}
        self._groups_finished_at: float | None = None

    def live(self) -> list[int]:
        """The groups with no loss open."""
        return [g.index for g in self.groups.values() if g.lost_at is None]

    def add_group(self, index: int) -> None:
        """A resize added group ``index`` (its ranks are in training, healing from a peer)."""
        self.groups[index] = GroupState(index)

    def remove_group(self, index: int) -> None:
        """A resize drained group ``index``: it leaves the run, no loss of it is open."""
        self.groups.pop(index, None)
        for key in [k for k in self.reports if k[0] == index]:
            del self.reports[key]
            self.pids.pop(key, None)
            self._last_seen.pop(key, None)

    # --- moves ------------------------------------------------------------------------
    def rank_down(self, key: RankKey, now: float, err: Exception) -> None:
        """Rank ``key``'s poll failed: its group is down (healthy -> down), and a
        standby takes its place (-> healing) or Ray restarts its ranks."""
        grp = self.groups.get(key[0])
        if grp is None:
            return  # a group a resize drained
        grp.lost_since_poll_fail = grp.lost_since_poll_fail or now
        if grp.lost_at is not None:
            return  # already lost: healing -> down, no second loss
        # torchft may have noticed first: a survivor committed in a smaller quorum.
        detected = min(now, self._shrunk_at) if self._shrunk_at else now
        grp.lost_at = max(detected, grp.last_ok)
        grp.failed_at = self._failed_at(key, self.pids.get(key), grp.lost_at)
        self.emit(
            LogEvent(
                level="warning",
                message=f"replica group {grp.index} lost (rank {key[1]}): {type(err).__name__}",
            )
        )
        if all(g.lost_at is not None and not g.finished for g in self.groups.values()):
            self._all_lost_at = min(g.lost_at or now for g in self.groups.values())
        if self.replace(key):
            grp.pid = None
            grp.restarts += 1
            grp.lost_since_poll_fail = None
            # The dead processes' pids must not be found dead again once it recovered.
            for rank in range(self.ranks_per_group):
                self.pids.pop((key[0], rank), None)
        elif self.ranks_per_group > 1:
            self.restart(key)
        # A survivor rank of the lost group may have reported its failed collective:
        # that error died with the processes being replaced.
        grp.error = None

    def rank_answered(self, key: RankKey, report: RankReport, now: float) -> None:
        """Rank ``key`` answered its poll: down -> healing; a new rank-0 process never
        seen down restarted between two polls: healthy -> healing."""
        g, rank = key
        grp = self.groups.get(g)
        if grp is None:
            return  # a group a resize drained
        grp.last_ok = now
        grp.lost_since_poll_fail = None
        if grp.pid is not None and report.pid != grp.pid and rank == 0:
            grp.restarts += 1
            if grp.lost_at is None:  # restarted between two polls
                grp.lost_at = report.started_at
                grp.failed_at = self._failed_at(key, grp.pid, grp.lost_at)
        self.pids[key] = report.pid
        self._last_seen[key] = now
        if rank == 0:
            grp.pid = report.pid
            grp.state = report.state
            grp.step = report.step
            grp.finished = report.state is RankState.finished
            grp.digest = report.digest
            grp.paused = report.paused_at is not None
            grp.boundary = report.boundary
        if report.error:
            grp.error = report.error
        self.reports[key] = report

    def step_committed(self, event: StepEvent, group: int) -> None:
        """Group ``group``'s rank 0 committed ``event``: a full quorum heals every group
        back in training (healing -> healthy); a smaller one is torchft's detection of a
        loss the polls have not seen yet."""
        grp = self.groups.get(group)
        if grp is None:
            return  # a group a resize drained: its last steps came after it left
        full = len(self.groups)
        if self._all_lost_at is not None and grp.lost_since_poll_fail is None:
            self._recovered(grp, event.ts)
        if event.quorum_size < full and self._shrunk_at is None and grp.lost_at is None:
            self._shrunk_at = event.ts
        if event.quorum_size == full:
            self._shrunk_at = None
            self._recovered(grp, event.ts)

    def step_failed(self) -> None:
        """A survivor's collective failed: ask Ray which ranks' processes ended and take
        them down now, without waiting for their polls to fail."""
        live = {pid: key for key, pid in self.pids.items() if self.groups[key[0]].lost_at is None}
        now = time.time()
        for pid in self.failure_times(list(live)):
            if self.groups[live[pid][0]].lost_at is None:
                self.rank_down(live[pid], now, RuntimeError("the process ended (Ray)"))

    # --- what the run is told ---------------------------------------------------------
    def interruption(
        self,
        kind: InterruptionKind,
        group: int | None,
        detected: float,
        recovered: float | None,
        detail: str,
        *,
        failed: float | None = None,
    ) -> None:
        self.interruptions += 1
        self.emit(
            InterruptionEvent(
                interruption_kind=kind,
                replica_group=group,
                failed_at=failed,
                detected_at=detected,
                recovered_at=recovered,
                detail=detail,
            )
        )

    def unrecovered(self) -> None:
        """The run ended: every loss still open is an interruption never recovered."""
        for g in self.groups.values():
            if g.lost_at is not None:
                self.interruption(
                    "replica_group_lost",
                    g.index,
                    g.lost_at,
                    None,
                    "not recovered before the run finished",
                    failed=g.failed_at,
                )

    def check_stuck(self, now: float) -> None:
        """Fail the run when every group failed, or none came back in time."""
        if not self.groups:
            return  # paused for capacity: no group to fail
        errors = [g.error for g in self.groups.values() if g.error]
        if errors and all(g.error or g.finished for g in self.groups.values()):
            raise ItoError(ErrorCode.training_failed, f"trainer failed: {errors[0]}")
        down = [
            g
            for g in self.groups.values()
            if g.lost_since_poll_fail is not None
            and now - g.lost_since_poll_fail > self.ft.actor_ready_timeout_s
        ]
        if len(down) == len(self.groups):
            raise ItoError(
                ErrorCode.all_replica_groups_lost,
                f"no replica group came back within {self.ft.actor_ready_timeout_s}s",
            )

    def every_rank_finished(self, ranks: set[RankKey]) -> bool:
        """Every group finished, and every rank of ``ranks`` said so too."""
        # Rank 0 speaks for its group's progress, but every other rank's final shard
        # digest comes on its own reply: wait for those too, bounded in case a rank
        # died after its last step.
        if not all(g.finished for g in self.groups.values()):
            return False
        now = time.time()
        if self._groups_finished_at is None:
            self._groups_finished_at = now
        return self._finished() >= ranks or now - self._groups_finished_at > self.ft.stop_timeout_s

    def stragglers_done(self) -> bool:
        """Some groups finished and every other one is lost."""
        # A group still down when its peers finished has nothing left to heal from.
        # Every group finished is ``every_rank_finished``'s case: it waits for digests.
        finished = [g.finished for g in self.groups.values()]
        return (
            any(finished)
            and not all(finished)
            and all(g.finished or g.lost_at is not None for g in self.groups.values())
        )

    # --- internals --------------------------------------------------------------------
    def _finished(self) -> set[RankKey]:
        """The ranks whose last answer said finished (with their final shard digest)."""
        return {k for k, r in self.reports.items() if r.state is RankState.finished}

    def _recovered(self, grp: GroupState, ts: float) -> None:
        if self._all_lost_at is not None:
            failed = [g.failed_at for g in self.groups.values() if g.failed_at is not None]
            self.interruption(
                "all_groups_lost",
                None,
                self._all_lost_at,
                ts,
                "every replica group was lost; restarted from the newest complete checkpoint",
                failed=min(failed, default=None),
            )
            self._all_lost_at = None
            for g in self.groups.values():
                g.lost_at = g.failed_at = None
            return
        for g in self.groups.values():
            if (
                g.lost_at is not None
                and g.pid is not None
                and g.lost_since_poll_fail is None
                and (g is grp or g.state is RankState.training)
            ):
                self.interruption(
                    "replica_group_lost",
                    g.index,
                    g.lost_at,
                    ts,
                    f"healed from a live peer after {g.restarts} restart(s)",
                    failed=g.failed_at,
                )
                g.lost_at = g.failed_at = None

    def _failed_at(self, key: RankKey, pid: int | None, detected: float) -> float:
        """When rank ``key``'s process ``pid`` died: Ray's record of its end, else the
        last poll it answered (never after its loss was detected)."""
        died = self.failure_time(pid)
        if died is None:
            died = self._last_seen.get(key, detected)
        return min(died, detected)
