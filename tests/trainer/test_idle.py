"""Work ahead of need runs on a thread of its own at SCHED_IDLE; the caller's thread
keeps its policy (an unprivileged thread could not get it back)."""

from __future__ import annotations

import os

import pytest

from stages.trainer.rank.idle import idle_thread, run_when_idle

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


def test_the_work_runs_at_idle_priority_and_the_caller_keeps_its_own() -> None:
    seen: list[int] = []
    before = os.sched_getscheduler(0)
    run_when_idle(lambda: seen.append(os.sched_getscheduler(0)), name="probe")
    assert seen == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before != os.SCHED_IDLE


def test_a_failure_of_the_work_is_raised_on_the_caller() -> None:
    def fail() -> None:
        raise ValueError("warm-up failed")

    with pytest.raises(ValueError, match="warm-up failed"):
        run_when_idle(fail, name="probe")


def test_an_idle_thread_is_a_started_daemon() -> None:
    thread = idle_thread(lambda: None, name="imports")
    thread.join(timeout=10)
    assert thread.daemon and thread.name == "imports" and not thread.is_alive()
