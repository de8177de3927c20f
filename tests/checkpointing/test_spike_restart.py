"""The checkpointing pieces together: a planted spike -> proposal -> approval -> restart from the
checkpoint with the data window skipped (stages/trainer/rank/loop.py drives this)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers.waiting import wait_until

from stages.base import StageContext
from stages.checkpointing import Checkpointer, CheckpointPolicy
from stages.trainer.config import LossSpikeConfig
from stages.trainer.rank.loss_spike import LossSpikeDetector
from stages.trainer.rank.train_state import set_determinism

Tiny = Any  # the ``tiny`` fixture of conftest.py

DECISION_TIMEOUT_S = 30.0


def test_planted_spike_restarts_only_after_approval_and_skips_the_window(
    tiny: Tiny, policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    set_determinism(tiny.seed)
    state = tiny.state()
    det = LossSpikeDetector(
        LossSpikeConfig(window=10, min_steps=5, z_threshold=6.0, skip_window_steps=3)
    )
    state.extras["loss_spike"] = det
    ctx = StageContext(run_id="r", booking_id="b", workdir=tmp_path)
    events: list[Any] = []
    with Checkpointer(policy(interval_steps=4, keep=3)) as ck:
        spike_event = None
        while state.step < 12:
            loss = tiny.train(state, 1)[0]
            if state.step == 11:
                loss = 100.0  # planted: what a poisoned batch would do
            spike = det.observe(state.step, loss)
            if spike is not None:
                latest = ck.latest()
                spike_event = det.propose(spike, latest.step if latest else None, 1)
                events.append(spike_event)
                break
            if ck.due(state.step):
                ck.save(state.step, state)
                ck.wait()
        assert spike_event is not None and spike_event.params["spike_step"] == 11
        assert spike_event.params["from_step"] == 8
        assert spike_event.params["skip_batches"] == 3  # steps 9..11

        # Nothing restarts by itself: with no decision the wait times out.
        assert ctx.wait_decision(spike_event.proposal_id, timeout_s=0.05) is None
        # A decision on another proposal, made while the loop waits on this one, does
        # not release it; this proposal's own decision does.
        answers: list[str | None] = []
        waiter = threading.Thread(
            target=lambda: answers.append(
                ctx.wait_decision(spike_event.proposal_id, DECISION_TIMEOUT_S)
            )
        )
        waiter.start()
        waiting = ctx._decided._waiters  # type: ignore[attr-defined]
        wait_until(lambda: waiting, DECISION_TIMEOUT_S, "the loop waits")
        ctx.decide("some-other-proposal", "approved")  # wakes the waiter (notify_all)
        wait_until(
            lambda: waiting or not waiter.is_alive(), DECISION_TIMEOUT_S, "the waiter settles"
        )
        assert waiter.is_alive() and answers == []  # it went back to waiting
        ctx.decide(spike_event.proposal_id, "approved")
        waiter.join(DECISION_TIMEOUT_S)
        assert answers == ["approved"]

        record = next(r for r in ck.records() if r.step == spike_event.params["from_step"])
        ck.load(record, state)
        assert state.loader is not None
        state.loader.skip(spike_event.params["skip_batches"])  # type: ignore[attr-defined]
        ck.discard_after(record.step)
        assert state.step == 8 and state.loader.batches_served == 11  # type: ignore[attr-defined]
        # The detector came back with the checkpoint: no memory of the spike's window.
        assert det.spikes == 0 and det.observed == 8

        # The next batch is the one an uninterrupted loader serves after step 11.
        fresh = tiny.state()
        fresh.loader.skip(11)  # type: ignore[union-attr]
        assert torch.equal(
            state.loader.next_batch(),  # type: ignore[attr-defined]
            fresh.loader.next_batch(),
        )  # type: ignore[union-attr]
        assert [r.step for r in ck.records()] == [4, 8]
