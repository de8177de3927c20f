"""The rollout fleet's gauges: from ``metrics`` events to ``ito metrics`` and /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.telemetry.goodput import compute_run_metrics
from orchestrator.telemetry.metrics_view import RunSample
from orchestrator.telemetry.prometheus import POST_TRAINING_GAUGES, TelemetryCollector
from stages.events import InterruptionEvent, MetricsEvent


def test_latest_rlvr_gauges_reach_run_metrics_and_prometheus() -> None:
    keys = [k for k, _, _ in POST_TRAINING_GAUGES]
    events = [
        MetricsEvent(
            stage="post_training", step=1, scope="rlvr", values=dict.fromkeys(keys, 1.0)
        ).model_dump(mode="json"),
        MetricsEvent(
            stage="post_training",
            step=2,
            scope="rlvr",
            values={**dict.fromkeys(keys, 2.0), "mean_reward": 0.75},
        ).model_dump(mode="json"),
        MetricsEvent(
            stage="post_training", step=0, scope="sft", values={"mean_reward": 99.0}
        ).model_dump(mode="json"),
        InterruptionEvent(
            interruption_kind="rollout_worker_lost", detected_at=10.0, recovered_at=12.0
        ).model_dump(mode="json"),
    ]
    m = compute_run_metrics(events, started_at=0.0, now=100.0)
    assert m.post_training["mean_reward"] == 0.75  # the latest rlvr step wins
    assert m.post_training["staleness_max"] == 2.0
    assert m.interruptions == 1 and m.recover_s == [2.0]  # a rollout worker loss counts
    reg = CollectorRegistry()
    reg.register(TelemetryCollector(lambda: [RunSample("r1", "b1", "running", m)]))
    text = generate_latest(reg).decode()
    for _, family, _ in POST_TRAINING_GAUGES:
        assert f"{family}{{" in text, family
    assert 'ito_run_rl_mean_reward{booking_id="b1",run_id="r1"} 0.75' in text
