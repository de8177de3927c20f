"""Goodput arithmetic on hand-made event streams (the numbers /metrics shows)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.telemetry.goodput import aggregate, compute_run_metrics
from orchestrator.telemetry.metrics_view import RunSample
from orchestrator.telemetry.prometheus import TelemetryCollector


def _step(
    step: int,
    seconds: float,
    *,
    group: int = 0,
    committed: bool = True,
    tokens: int = 100,
    loss: float = 2.0,
) -> dict:
    return {
        "kind": "step",
        "step": step,
        "replica_group": group,
        "seconds": seconds,
        "committed": committed,
        "tokens": tokens,
        "loss": loss,
        "quorum_size": 2,
    }


def test_goodput_counts_each_step_once_across_groups_and_redone_steps_once() -> None:
    events = [
        {"kind": "phase", "phase": "startup", "start": 0.0, "end": 10.0},
        _step(1, 2.0, group=0),
        _step(1, 2.0, group=1),
        _step(2, 2.0, group=0),
        _step(2, 2.0, group=1),
        _step(3, 9.0, committed=False),  # a failed step is not productive
        # an approved restart redid step 2: only the last execution counts
        _step(2, 3.0, group=0),
        {"kind": "phase", "phase": "checkpoint_blocking", "start": 14.0, "end": 15.0},
        {"kind": "phase", "phase": "recovery", "start": 20.0, "end": 24.0},
        {"kind": "phase", "phase": "recovery", "start": 22.0, "end": 25.0},  # overlapping
        {
            "kind": "interruption",
            "interruption_kind": "replica_group_lost",
            "replica_group": 1,
            "detected_at": 20.0,
            "recovered_at": 25.0,
        },
        {
            "kind": "checkpoint",
            "step": 2,
            "path": "/x",
            "bytes": 1000,
            "blocking_s": 0.5,
            "total_s": 2.0,
        },
    ]
    m = compute_run_metrics(events, started_at=0.0, now=40.0)
    assert m.productive_s == pytest.approx(2.0 + 3.0)
    assert m.goodput == pytest.approx(5.0 / 40.0)
    assert m.badput_s["startup"] == pytest.approx(10.0)
    assert m.badput_s["checkpoint_blocking"] == pytest.approx(1.0)
    assert m.badput_s["recovery"] == pytest.approx(5.0)  # merged span 20..25
    assert m.badput_s["idle"] == pytest.approx(40.0 - 5.0 - 16.0)
    # Each step's tokens are the whole quorum's: steps 1 and 2 count once each, however
    # many groups reported them and however often they were redone.
    assert m.steps_committed == 2 and m.steps_uncommitted == 1
    assert m.tokens == 200
    assert m.tokens_per_s == pytest.approx(200 / 40.0)
    assert m.interruptions == 1 and m.recover_s == [5.0]
    assert m.interruption_rate_per_h == pytest.approx(1 / (40 / 3600))
    assert m.checkpoint_bytes_per_s == pytest.approx(500.0)


def test_post_training_steps_are_productive_time_of_their_own() -> None:
    """SFT and DPO count their steps from 1 again: each (stage, phase, step) is one step,
    so they add to pretraining's productive time instead of replacing its steps."""
    pretrain = [{**_step(s, 2.0), "stage": "train", "phase": "pretrain"} for s in (1, 2)]
    sft = [{**_step(s, 3.0), "stage": "post_training", "phase": "sft"} for s in (1, 2)]
    dpo = [{**_step(1, 4.0, group=g), "stage": "post_training", "phase": "dpo"} for g in (0, 1)]
    m = compute_run_metrics(pretrain + sft + dpo, started_at=0.0, now=20.0)
    assert m.steps_committed == 5
    assert m.productive_s == pytest.approx(2 * 2.0 + 2 * 3.0 + 4.0)


def test_each_second_is_attributed_once_and_the_breakdown_adds_up_to_elapsed() -> None:
    """A post-training stage under the driver's stage-long start-up span: its steps'
    own time is productive and its battery's span is evaluation, not start-up too."""
    events = [
        {"kind": "phase", "phase": "startup", "start": 0.0, "end": 10.0},  # data prep
        *({**_step(s, 1.0), "ts": 10.0 + s} for s in (1, 2, 3)),  # 10..13
        {"kind": "phase", "phase": "evaluation", "start": 13.0, "end": 14.0},
        {"kind": "phase", "phase": "startup", "start": 14.0, "end": 30.0},  # post-training
        *({**_step(s, 2.0), "stage": "post_training", "ts": 18.0 + 2 * s} for s in (1, 2)),
        {"kind": "phase", "phase": "evaluation", "start": 22.0, "end": 24.0},
        {"kind": "phase", "phase": "checkpoint_blocking", "start": 21.5, "end": 22.5},
    ]
    m = compute_run_metrics(events, started_at=0.0, now=32.0)
    assert m.productive_s == pytest.approx(3.0 + 4.0)
    assert m.badput_s["checkpoint_blocking"] == pytest.approx(0.5)  # 21.5..22 is a step's
    assert m.badput_s["evaluation"] == pytest.approx(1.0 + 1.5)
    assert m.badput_s["startup"] == pytest.approx(10.0 + (16.0 - 4.0 - 2.0))
    assert m.badput_s["idle"] == pytest.approx(2.0)  # 30..32
    assert m.productive_s + sum(m.badput_s.values()) == pytest.approx(m.elapsed_s)


def test_merged_step_events_cover_the_time_of_the_steps_they_stand_for() -> None:
    merged = {**_step(4, 3.0, tokens=300), "first_step": 2, "ts": 13.0}  # steps 2..4
    events = [{"kind": "phase", "phase": "startup", "start": 0.0, "end": 13.0}, merged]
    m = compute_run_metrics(events, started_at=0.0, now=13.0)
    assert m.steps_committed == 3 and m.productive_s == pytest.approx(3.0)
    assert m.badput_s["startup"] == pytest.approx(10.0) and m.badput_s["idle"] == 0.0


def test_uncovered_seconds_match_a_fine_grid() -> None:
    import random

    from orchestrator.telemetry.goodput import _merge_spans, _uncovered_s

    rng = random.Random(0)
    for _ in range(200):

        def spans() -> list[tuple[float, float]]:
            out = []
            for _ in range(rng.randint(0, 6)):
                a = rng.randint(0, 40) / 2
                out.append((a, a + rng.randint(1, 12) / 2))
            return _merge_spans(out)

        s, cover = spans(), spans()
        grid = [i / 4 + 1 / 8 for i in range(4 * 30)]  # quarter-second cells, by centre
        expected = sum(
            0.25
            for t in grid
            if any(a <= t < b for a, b in s) and not any(a <= t < b for a, b in cover)
        )
        assert _uncovered_s(s, cover) == pytest.approx(expected), (s, cover)


def test_booking_aggregate_pools_time_not_ratios() -> None:
    a = compute_run_metrics([_step(1, 10.0)], started_at=0, now=10)  # goodput 1.0
    b = compute_run_metrics([_step(1, 10.0)], started_at=0, now=90)  # goodput 0.111
    agg = aggregate([a, b])
    assert agg.goodput == pytest.approx(20.0 / 100.0)


def test_prometheus_collector_labels_run_and_booking() -> None:
    m = compute_run_metrics([_step(1, 5.0)], started_at=0, now=10)
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(lambda: [RunSample("run_a", "bk_1", "running", m)]))
    text = generate_latest(registry).decode()
    assert 'ito_run_goodput_ratio{booking_id="bk_1",run_id="run_a"} 0.5' in text
    assert 'ito_booking_goodput_ratio{booking_id="bk_1"} 0.5' in text
    assert 'cause="idle"' in text
    assert "job=" not in text


def test_stage_progress_reaches_metrics_prometheus_and_status_line() -> None:
    from orchestrator.client.render import run as render_run
    from stages.events import ProgressEvent

    def prog(step: str, i: int, done: int, eta: float | None) -> dict:
        return ProgressEvent(
            stage="data_prep",
            step=step,
            step_index=i,
            steps=7,
            tasks_done=done,
            tasks_total=80,
            docs_done=done * 20_000,
            docs_total=1_600_000,
            bytes_done=done * 11_000_000,
            bytes_total=880_000_000,
            elapsed_s=30.0 * (i + 1),
            eta_s=eta,
        ).model_dump(mode="json")

    events = [prog("sketch", 0, 80, 0.0), prog("fetch", 3, 12, 95.4), _step(1, 5.0)]
    m = compute_run_metrics(events, started_at=0, now=10)
    assert m.stage_progress is not None and m.stage_progress["step"] == "fetch"
    assert m.stage_progress["docs_done"] == 240_000 and m.stage_progress["eta_s"] == 95.4
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(lambda: [RunSample("run_a", "bk_1", "running", m)]))
    text = generate_latest(registry).decode()
    labels = 'booking_id="bk_1",run_id="run_a",stage="data_prep",step="fetch"'
    assert f"ito_run_stage_progress_documents{{{labels}}} 240000.0" in text
    assert f"ito_run_stage_progress_documents_total{{{labels}}} 1.6e+06" in text
    assert f"ito_run_stage_progress_eta_seconds{{{labels}}} 95.4" in text
    line = render_run({"run_id": "run_a", "state": "running", "stage_progress": m.stage_progress})
    assert (
        "data_prep fetch (4/7): 12/80 tasks, 240000/1600000 documents, 132.0/880.0 MB, eta 1m35s"
    ) in line
    # No progress yet: no gauge, no line.
    quiet = compute_run_metrics([_step(1, 5.0)], started_at=0, now=10)
    assert quiet.stage_progress is None
    assert "stage_progress" not in render_run({"run_id": "r", "state": "running"})


def test_each_interruption_reports_detect_and_recover_seconds_from_the_failure() -> None:
    lost = {
        "kind": "interruption",
        "interruption_kind": "replica_group_lost",
        "replica_group": 1,
        "failed_at": 10.0,
        "detected_at": 10.5,
        "recovered_at": 13.0,
    }
    spike = {
        "kind": "interruption",
        "interruption_kind": "loss_spike",
        "detected_at": 20.0,
        "recovered_at": 22.0,
    }  # no failure time: from detection
    down = {**lost, "failed_at": 30.0, "detected_at": 31.0, "recovered_at": None}
    m = compute_run_metrics([lost, spike, down], started_at=0, now=40)
    assert m.detect_s == [0.5, 1.0]
    assert m.recover_s == [3.0, 2.0]
    assert [
        (t.index, t.detect_s is not None, t.recover_s is not None) for t in m.interruption_timings
    ] == [(0, True, True), (1, False, True), (2, True, False)]
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(lambda: [RunSample("run_a", "bk_1", "running", m)]))
    text = generate_latest(registry).decode()
    labels = 'booking_id="bk_1",interruption="0",kind="replica_group_lost",run_id="run_a"'
    assert f"ito_run_interruption_detect_seconds{{{labels}}} 0.5" in text
    assert f"ito_run_interruption_recover_seconds{{{labels}}} 3.0" in text
    assert 'ito_run_interruption_detect_seconds{booking_id="bk_1",interruption="1"' not in text
