"""LossSpikeDetector: robust z-score, non-finite losses, proposals, state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stages.trainer.config import LossSpikeConfig
from stages.trainer.rank.loss_spike import LossSpikeDetector


def noisy_losses(n: int, seed: int = 0) -> list[float]:
    """A decaying training curve with multiplicative noise and rare mild bumps."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    curve = 2.0 + 3.0 * np.exp(-steps / 80)
    return list(curve * (1 + 0.02 * rng.standard_normal(n)))


def test_a_normal_run_has_no_spikes() -> None:
    det = LossSpikeDetector(LossSpikeConfig())
    assert [s for i, x in enumerate(noisy_losses(600)) if (s := det.observe(i, x))] == []


def test_a_planted_spike_is_caught_at_its_step() -> None:
    det = LossSpikeDetector(LossSpikeConfig(window=30, z_threshold=6.0, min_steps=20))
    losses = noisy_losses(200, seed=1)
    losses[120] *= 1.5
    spikes = [s for i, x in enumerate(losses) if (s := det.observe(i, x))]
    assert [s.step for s in spikes] == [120]
    assert spikes[0].z > 6.0 and spikes[0].loss == losses[120]
    # The spike stayed out of the window: the same bump right after is still a spike.
    assert det.observe(200, losses[120]) is not None
    # Downward jumps are good news, not spikes.
    assert det.observe(201, losses[199] * 0.5) is None


def test_non_finite_losses_are_spikes_even_during_warmup() -> None:
    det = LossSpikeDetector(LossSpikeConfig(min_steps=50))
    for i, x in enumerate(noisy_losses(10)):
        assert det.observe(i, x) is None
    for bad in (math.nan, math.inf):
        spike = det.observe(10, bad)
        assert spike is not None and spike.non_finite and spike.z == math.inf
    assert det.spikes == 2


def test_no_detection_before_min_steps_or_when_disabled() -> None:
    det = LossSpikeDetector(LossSpikeConfig(min_steps=30))
    losses = noisy_losses(40, seed=2)
    losses[25] *= 3
    assert all(det.observe(i, x) is None for i, x in enumerate(losses))
    off = LossSpikeDetector(LossSpikeConfig(enabled=False))
    assert off.observe(1, math.nan) is None


def test_a_flat_loss_does_not_divide_by_zero() -> None:
    det = LossSpikeDetector(LossSpikeConfig(window=10, min_steps=5))
    for i in range(20):
        assert det.observe(i, 1.0) is None
    assert det.observe(20, 1.0001) is None  # a wiggle of 1e-4 against a 1e-3 floor
    spike = det.observe(21, 1.1)
    assert spike is not None and math.isfinite(spike.z) and spike.mad == 0.0


def test_proposal_restarts_from_the_checkpoint_and_skips_through_the_spike() -> None:
    det = LossSpikeDetector(LossSpikeConfig(skip_window_steps=10, min_steps=5))
    for i, x in enumerate(noisy_losses(50)):
        det.observe(i, x)
    spike = det.observe(57, 50.0)
    assert spike is not None
    event = det.propose(spike, latest_checkpoint_step=40, batches_per_step=4)
    assert event.action == "restart_from_checkpoint"
    assert event.params["from_step"] == 40 and event.params["from_checkpoint"]
    assert event.params["window_start_step"] == 41 and event.params["window_end_step"] == 57
    assert event.params["skip_steps"] == 17 and event.params["skip_batches"] == 68
    assert "checkpoint 40" in event.description and "step 57" in event.description
    # A spike right after the checkpoint still skips at least skip_window_steps.
    near = det.propose(spike.model_copy(update={"step": 42}), 40, batches_per_step=1)
    assert near.params["skip_batches"] == 10 and near.params["window_end_step"] == 50
    assert near.proposal_id != event.proposal_id
    # Without a checkpoint the restart is from step 0; the event stays valid JSON.
    nan_spike = det.observe(58, math.nan)
    assert nan_spike is not None
    scratch = det.propose(nan_spike, None)
    assert scratch.params["from_step"] == 0 and not scratch.params["from_checkpoint"]
    assert scratch.params["loss"] is None and scratch.params["non_finite"]
    json.loads(scratch.model_dump_json())
    with pytest.raises(ValueError):
        det.propose(spike, 40, batches_per_step=0)


def test_state_round_trip_gives_identical_decisions() -> None:
    cfg = LossSpikeConfig(window=20, min_steps=10)
    losses = noisy_losses(120, seed=3)
    losses[90] *= 1.4
    a = LossSpikeDetector(cfg)
    for i, x in enumerate(losses[:60]):
        a.observe(i, x)
    b = LossSpikeDetector(cfg)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for i, x in enumerate(losses[60:], start=60):
        sa, sb = a.observe(i, x), b.observe(i, x)
        assert sa == sb
    assert a.spikes == b.spikes == 1
    b.reset()
    assert b.observe(200, 1000.0) is None  # warming up again after a reset
