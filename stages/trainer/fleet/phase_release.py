"""The ranks at a curriculum phase's end: run its gate once, then release or stop them.

A rank that closes a phase saves the closing checkpoint, reports the phase's index as
its ``boundary`` (``RankState.phase_end``) and waits. When every live rank waits at the
same boundary, the gate hook runs once: passed, every rank is told ``next_phase``;
failed, the run stops there. A rank that comes back at a boundary whose gate already
passed (restarted, or resumed from a closing checkpoint) is released at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stages.curriculum.schedule import CurriculumSchedule, PhaseSpan
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.fleet.supervision import RankKey
from stages.trainer.rank.rank_state import RankReport, RankState

# Called when every live group closed a phase; True: the gate passed, go on.
PhaseEndHook = Callable[[PhaseSpan], bool]


class PhaseRelease:
    """``decided``: phases whose gate already passed (a run resumed after them)."""

    def __init__(
        self,
        schedule: CurriculumSchedule,
        *,
        ft: FaultToleranceConfig,
        on_phase_end: PhaseEndHook | None,
        decided: Iterable[int],
    ):
        self.schedule = schedule
        self.ft = ft
        self.on_phase_end: PhaseEndHook = on_phase_end or (lambda phase: True)
        self.passed: set[int] = set(decided)
        self.stopped_at_phase: int | None = None
        # (boundary, pid) each rank was last told to leave: a poll in flight may show
        # it again; a restarted process (new pid) at the same boundary is told again.
        self._released: dict[RankKey, tuple[int, int]] = {}
        # The phase that a rank reporting this many committed steps is closing.
        self._ending_at = {p.end_step: p.index for p in schedule.phases}

    def observe(self, key: RankKey, report: RankReport, actor: Any, ranks: int) -> float | None:
        """Take in rank ``key``'s report (``ranks``: how many the run has): release it at
        once at a boundary whose gate already passed. Returns how
        soon to poll it again when its closing save is in flight (its boundary, and so
        the gate, is polled for sooner than the next regular poll); else None."""
        b = report.boundary
        if b is not None and b in self.passed and self._released.get(key) != (b, report.pid):
            # Resumed (or restarted) at a boundary whose gate already passed.
            self._released[key] = (b, report.pid)
            actor.command.remote("next_phase", {})
        closing = self._ending_at.get(report.step)
        if (
            report.state is RankState.training
            and report.boundary is None
            and closing is not None
            and closing not in self.passed
        ):
            return min(self.ft.poll_interval_s, ranks / self.ft.phase_end_polls_per_s)
        return None

    def gate(
        self,
        live: list[RankKey],
        ranks: Iterable[RankKey],
        reports: Mapping[RankKey, RankReport],
        release: Callable[[], None],
    ) -> bool:
        """Every ``live`` rank waits at the same phase end (``reports``: each rank's last
        answer): run its gate, then ``release`` every rank (passed) or stop the run
        (failed). True when a gate ran."""
        marks = {r.boundary if (r := reports.get(k)) else None for k in live}
        if not live or len(marks) != 1:
            return False
        b = marks.pop()
        if b is None or b in self.passed:
            return False
        if not self.on_phase_end(self.schedule.phases[b]):
            self.stopped_at_phase = b
            return True
        self.passed.add(b)
        for k in ranks:
            self._released[k] = (b, reports[k].pid if k in reports else 0)
        release()
        return True
