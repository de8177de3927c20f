"""Eval scores and evaluation badput in the telemetry (pure, from events)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.telemetry.goodput import compute_run_metrics
from orchestrator.telemetry.metrics_view import RunSample
from orchestrator.telemetry.prometheus import TelemetryCollector
from stages.events import CheckpointEvent, EvalEvent, PhaseEvent


def _events() -> list[dict[str, object]]:
    ck = CheckpointEvent(
        step=10, path="/c/step_10", bytes=1000, blocking_s=0.1, total_s=1.0, phase="pretrain"
    )
    return [
        e.model_dump(mode="json")
        for e in (
            ck,
            ck.model_copy(update={"closes_phase": True}),  # re-announced at the phase end
            PhaseEvent(phase="evaluation", start=100.0, end=104.0),
            EvalEvent(
                phase="pretrain",
                battery="smoke",
                check="heldout_loss",
                score=3.5,
                passed=True,
                max=6.0,
            ),
            EvalEvent(
                phase="long",
                battery="smoke",
                check="heldout_loss",
                score=3.9,
                passed=False,
                max=0.001,
            ),
            EvalEvent(
                phase="long",
                battery="smoke",
                check="gsm8k_exact_match",
                score=None,
                passed=False,
                reason="timeout",
            ),
        )
    ]


def test_scores_and_evaluation_badput() -> None:
    m = compute_run_metrics(_events(), started_at=90.0, now=110.0)
    assert m.badput_s["evaluation"] == 4.0
    assert m.checkpoints == 1 and m.checkpoint_bytes == 1000  # counted once
    assert m.eval_scores == [
        {"phase": "pretrain", "check": "heldout_loss", "score": 3.5, "passed": True},
        {"phase": "long", "check": "heldout_loss", "score": 3.9, "passed": False},
    ]
    reg = CollectorRegistry()
    reg.register(TelemetryCollector(lambda: [RunSample("r1", "bk", "failed", m)]))
    text = generate_latest(reg).decode()
    assert (
        'ito_run_eval_score{booking_id="bk",check="heldout_loss",phase="long",run_id="r1"} 3.9'
    ) in text
    assert 'check="gsm8k_exact_match"' not in text  # no number, no sample
