"""Each move of a replica group's health (``GroupSupervisor``), driven by the polls and
steps the driver sees. No Ray here: when a process died (Ray's record) and the standby
pool are stand-ins passed to the supervisor, as the engine passes the real ones; the
engine's own runs with real kills are tests/trainer/test_ft_recovery.py."""

from __future__ import annotations

import pytest

from stages.errors import ErrorCode, ItoError
from stages.events import Event, InterruptionEvent, LogEvent, StepEvent
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.fleet.supervision import (
    GROUP_TRANSITIONS,
    GroupHealth,
    GroupSupervisor,
    RankKey,
)
from stages.trainer.rank.rank_state import RankReport, RankState

DIED_AT = 95.0  # when Ray says every lost process ended


class Run:
    """A supervisor of ``groups`` single-rank groups and what it emitted."""

    def __init__(self, groups: int = 2, *, standby: bool = False, ranks: int = 1) -> None:
        self.events: list[Event] = []
        self.replaced: list[RankKey] = []
        self.restarted: list[RankKey] = []
        self.dead_pids: set[int] = set()
        self.standby = standby
        self.sup = GroupSupervisor(
            groups,
            ranks_per_group=ranks,
            ft=FaultToleranceConfig(),
            emit=self.events.append,
            replace=self._replace,
            restart=self.restarted.append,
            failure_time=lambda pid: DIED_AT if pid in self.dead_pids else None,
            failure_times=lambda pids: {p: DIED_AT for p in pids if p in self.dead_pids},
        )
        for g in range(groups):
            for r in range(ranks):
                self.answer((g, r), pid=100 + 10 * g + r, now=90.0)

    def _replace(self, key: RankKey) -> bool:
        if self.standby:
            self.replaced.append(key)
        return self.standby

    def answer(self, key: RankKey, *, pid: int, now: float, started_at: float = 0.0) -> None:
        report = RankReport(pid=pid, state=RankState.training, started_at=started_at)
        self.sup.rank_answered(key, report, now)

    def commit(self, group: int, quorum: int, ts: float) -> None:
        event = StepEvent(step=1, loss=1.0, tokens=1, seconds=0.1, committed=True, ts=ts)
        event.quorum_size = quorum
        self.sup.step_committed(event, group)

    def health(self) -> list[GroupHealth]:
        return [g.health for g in self.sup.groups.values()]

    def interruptions(self) -> list[InterruptionEvent]:
        return [e for e in self.events if isinstance(e, InterruptionEvent)]


def _moved(before: GroupHealth, after: GroupHealth) -> None:
    assert after in GROUP_TRANSITIONS[before], f"{before} -> {after} is not in the table"


def test_healthy_to_down_when_a_poll_fails() -> None:
    run = Run()
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError("actor died"))
    _moved(GroupHealth.healthy, run.health()[1])
    assert run.health() == [GroupHealth.healthy, GroupHealth.down]
    lost = run.sup.groups[1]
    assert lost.lost_at == 100.0 and lost.failed_at == 90.0  # its last answer, Ray silent
    assert any(isinstance(e, LogEvent) and "group 1 lost" in e.message for e in run.events)


def test_torchft_seeing_the_loss_first_dates_its_detection() -> None:
    """A survivor committed without group 1 at 97 s; the poll failed at 100 s."""
    run = Run()
    run.dead_pids.add(110)
    run.commit(0, quorum=1, ts=97.0)
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError())
    assert (run.sup.groups[1].lost_at, run.sup.groups[1].failed_at) == (97.0, DIED_AT)


def test_down_to_healing_at_once_when_a_standby_takes_the_place() -> None:
    run = Run(standby=True)
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError())
    _moved(GroupHealth.down, run.health()[1])
    assert run.replaced == [(1, 0)] and run.health()[1] is GroupHealth.healing
    assert run.sup.groups[1].restarts == 1 and (1, 0) not in run.sup.pids


def test_a_multi_rank_group_with_no_standby_has_ray_restart_its_other_ranks() -> None:
    run = Run(ranks=2)
    run.sup.rank_down((0, 1), now=100.0, err=RuntimeError())
    assert run.restarted == [(0, 1)] and run.health()[0] is GroupHealth.down


def test_down_to_healing_when_a_new_process_answers() -> None:
    run = Run()
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError())
    run.answer((1, 0), pid=999, now=103.0, started_at=101.0)
    _moved(GroupHealth.down, run.health()[1])
    assert run.health()[1] is GroupHealth.healing and run.sup.groups[1].restarts == 1


def test_healthy_to_healing_when_a_restart_fell_between_two_polls() -> None:
    run = Run()
    run.dead_pids.add(110)
    run.answer((1, 0), pid=999, now=103.0, started_at=101.5)
    _moved(GroupHealth.healthy, run.health()[1])
    assert run.health()[1] is GroupHealth.healing
    assert (run.sup.groups[1].lost_at, run.sup.groups[1].failed_at) == (101.5, DIED_AT)


def test_healing_to_down_when_the_new_process_dies_too() -> None:
    run = Run()
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError())
    run.answer((1, 0), pid=999, now=103.0)
    run.sup.rank_down((1, 0), now=104.0, err=RuntimeError())
    _moved(GroupHealth.healing, run.health()[1])
    assert run.health()[1] is GroupHealth.down
    assert run.sup.groups[1].lost_at == 100.0  # the same loss, not a second one
    assert sum("lost" in getattr(e, "message", "") for e in run.events) == 1


def test_healing_to_healthy_at_the_first_full_quorum() -> None:
    run = Run()
    run.dead_pids.add(110)
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError())
    run.answer((1, 0), pid=999, now=103.0)
    run.commit(0, quorum=1, ts=104.0)  # still without it: no recovery yet
    assert run.health()[1] is GroupHealth.healing and not run.interruptions()
    run.commit(0, quorum=2, ts=106.0)
    _moved(GroupHealth.healing, run.health()[1])
    [interruption] = run.interruptions()
    assert interruption.interruption_kind == "replica_group_lost"
    assert interruption.replica_group == 1
    assert (interruption.failed_at, interruption.detected_at, interruption.recovered_at) == (
        DIED_AT,
        100.0,
        106.0,
    )
    assert run.health() == [GroupHealth.healthy] * 2 and run.sup.interruptions == 1


def test_a_group_still_down_is_not_healed_by_a_full_quorum_report() -> None:
    run = Run(groups=3)
    run.sup.rank_down((2, 0), now=100.0, err=RuntimeError())
    run.commit(0, quorum=3, ts=101.0)  # a report from before the loss, read late
    assert run.health()[2] is GroupHealth.down and not run.interruptions()


def test_every_group_lost_is_one_interruption_healed_from_a_checkpoint() -> None:
    run = Run()
    run.dead_pids.update({100, 110})
    run.sup.rank_down((0, 0), now=100.0, err=RuntimeError())
    run.sup.rank_down((1, 0), now=100.5, err=RuntimeError())
    assert run.health() == [GroupHealth.down] * 2
    run.answer((0, 0), pid=500, now=110.0)  # restored from the newest checkpoint
    run.commit(0, quorum=1, ts=112.0)
    _moved(GroupHealth.down, run.health()[1])
    [interruption] = run.interruptions()
    assert interruption.interruption_kind == "all_groups_lost"
    assert (interruption.detected_at, interruption.recovered_at) == (100.0, 112.0)
    assert run.health() == [GroupHealth.healthy] * 2


def test_a_failed_collective_takes_dead_ranks_down_before_their_polls_fail() -> None:
    run = Run()
    run.dead_pids.add(110)
    run.sup.step_failed()
    assert run.health() == [GroupHealth.healthy, GroupHealth.down]


def test_the_run_fails_when_every_group_failed_or_none_came_back() -> None:
    run = Run()
    run.sup.groups[0].error = "boom"
    run.sup.groups[1].finished = True
    with pytest.raises(ItoError) as failed:
        run.sup.check_stuck(100.0)
    assert failed.value.code is ErrorCode.training_failed
    run = Run()
    for g in range(2):
        run.sup.rank_down((g, 0), now=100.0, err=RuntimeError())
    run.sup.check_stuck(100.0 + run.sup.ft.actor_ready_timeout_s)  # not yet
    with pytest.raises(ItoError) as lost:
        run.sup.check_stuck(101.0 + run.sup.ft.actor_ready_timeout_s)
    assert lost.value.code is ErrorCode.all_replica_groups_lost


def test_a_loss_open_at_the_end_is_reported_unrecovered() -> None:
    run = Run()
    run.sup.rank_down((1, 0), now=100.0, err=RuntimeError())
    run.sup.unrecovered()
    [interruption] = run.interruptions()
    assert interruption.recovered_at is None and interruption.replica_group == 1
