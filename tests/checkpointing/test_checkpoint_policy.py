"""Checkpointer.due: every N steps and/or M minutes (a fake clock, no sleeping)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.checkpointing import Checkpointer, CheckpointPolicy


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_every_n_steps(policy: Callable[..., CheckpointPolicy]) -> None:
    with Checkpointer(policy(interval_steps=5)) as ck:
        assert [s for s in range(0, 23) if ck.due(s)] == [5, 10, 15, 20]


def test_every_m_minutes(policy: Callable[..., CheckpointPolicy]) -> None:
    clock = FakeClock()
    with Checkpointer(policy(interval_steps=None, interval_minutes=2.0), clock=clock) as ck:
        assert not ck.due(1)
        clock.t += 119.0
        assert not ck.due(2)
        clock.t += 1.0
        assert ck.due(3)
        # An explicit ``now`` (e.g. rank 0's clock) wins over the local clock.
        assert not ck.due(3, now=clock.t - 60)


def test_time_interval_restarts_at_each_save(policy: Callable[..., CheckpointPolicy]) -> None:
    clock = FakeClock()
    state = {"w": torch.arange(4.0)}
    with Checkpointer(policy(interval_steps=None, interval_minutes=1.0), clock=clock) as ck:
        clock.t += 61
        assert ck.due(7)
        ck.save(7, state)
        assert not ck.due(8)  # the clock restarted at the save
        clock.t += 59
        assert not ck.due(9)
        clock.t += 1
        assert ck.due(10)
        rec = ck.wait()
        assert rec is not None and rec.step == 7  # due() alone saves nothing


def test_steps_and_minutes_together(policy: Callable[..., CheckpointPolicy]) -> None:
    clock = FakeClock()
    state = {"w": torch.arange(4.0)}
    with Checkpointer(policy(interval_steps=10, interval_minutes=5.0), clock=clock) as ck:
        assert [s for s in range(1, 11) if ck.due(s)] == [10]
        ck.save(10, state)
        clock.t += 300
        assert ck.due(13)  # the time interval fires between step multiples
        ck.save(13, state)
        assert not ck.due(13)  # never twice for one step
        assert ck.due(20)


def test_no_step_at_or_before_a_loaded_checkpoint_is_due(
    policy: Callable[..., CheckpointPolicy],
) -> None:
    state = {"w": torch.arange(4.0)}
    with Checkpointer(policy(interval_steps=2)) as ck:
        ck.save(6, state)
        record = ck.wait()
        assert record is not None
    with Checkpointer(policy(interval_steps=2)) as ck:
        ck.load(record, state)
        assert not ck.due(4) and not ck.due(6)
        assert ck.due(8)
