"""Resizes priced and shown: goodput's ``resize`` cause, the run's group count and
GPU-hours (the count changing at each applied resize), the Prometheus gauges, the
run view ``ito status`` renders, and the metrics of a run in a real store (SQLite
and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures import both_engines
from helpers.resizing import PLAN, embedded_place
from helpers.store_rows import insert_run
from helpers.tenants import booking_doc, make_tenant
from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.client import human, render
from orchestrator.db.store import Store
from orchestrator.runtime.resizing import Resizer
from orchestrator.telemetry.goodput import compute_run_metrics
from orchestrator.telemetry.metrics_view import RunSample, metrics_for
from orchestrator.telemetry.prometheus import TelemetryCollector
from orchestrator.telemetry.resizes import resize_history
from stages.events import ResizeEvent, StageResultEvent, StepEvent


def _step(step: int, ts: float, groups: int) -> dict[str, Any]:
    return {
        "kind": "step",
        "ts": ts,
        "step": step,
        "seconds": 2.0,
        "committed": True,
        "tokens": 100,
        "loss": 2.0,
        "quorum_size": groups,
    }


def _resize(action: str, ts: float, before: int, after: int, seconds: float) -> dict[str, Any]:
    return {
        "kind": "resize",
        "ts": ts,
        "request_id": f"r-{ts:g}",
        "action": action,
        "groups_before": before,
        "groups_after": after,
        "step": None,
        "seconds": seconds,
    }


GROW = [
    {"kind": "phase", "phase": "startup", "start": 0.0, "end": 10.0},
    *(_step(i, 10.0 + 2 * i, 2) for i in range(1, 6)),  # 10..20
    _step(6, 24.0, 2),  # the two groups step on while the third joins (21..25)
    _resize("applied", 25.0, 2, 3, 4.0),
    _step(7, 27.0, 3),
    _step(8, 29.0, 3),
]


def test_a_resize_is_its_own_badput_cause_and_changes_the_gpu_count() -> None:
    m = compute_run_metrics(GROW, started_at=0.0, now=30.0, planned_groups=2, ranks_per_group=4)
    # 21..25 less step 6's 22..24: 2 s of resize; the steps are productive.
    assert m.badput_s["resize"] == pytest.approx(2.0)
    assert m.badput_s["recovery"] == 0.0 and m.productive_s == pytest.approx(16.0)
    assert sum(m.badput_s.values()) + m.productive_s == pytest.approx(m.elapsed_s)
    assert m.replica_groups == 3
    # From the first step (10) to 25 at 2 groups, 25..30 at 3: 45 group-s x 4 GPUs.
    assert m.gpu_hours == pytest.approx(45 * 4 / 3600)
    (resize,) = m.resizes
    assert (resize.action, resize.groups_before, resize.groups_after) == ("applied", 2, 3)
    assert resize.seconds == 4.0


def test_a_paused_run_uses_no_gpus_until_capacity_returns() -> None:
    events = [
        _step(1, 12.0, 2),  # 10..12
        _resize("paused", 20.0, 2, 0, 1.0),
        _resize("applied", 40.0, 0, 1, 3.0),
        _step(2, 44.0, 1),
    ]
    m = compute_run_metrics(events, started_at=0.0, now=50.0, planned_groups=2, ranks_per_group=8)
    assert m.replica_groups == 1
    # 10..20 at 2 groups, 20..40 at none, 40..50 at 1: 30 group-s x 8 GPUs.
    assert m.gpu_hours == pytest.approx(30 * 8 / 3600)
    assert m.badput_s["resize"] == pytest.approx(1.0 + 3.0)
    # Without a plan the count is unknown until a resize says it; no GPU-hours.
    bare = compute_run_metrics(events[:1], started_at=0.0, now=50.0)
    assert bare.replica_groups is None and bare.gpu_hours is None


def test_prometheus_shows_the_group_count_and_each_resize() -> None:
    m = compute_run_metrics(GROW, started_at=0.0, now=30.0, planned_groups=2, ranks_per_group=4)
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(lambda: [RunSample("run_a", "bk_1", "running", m)]))
    text = generate_latest(registry).decode()
    assert 'ito_run_replica_groups{booking_id="bk_1",run_id="run_a"} 3.0' in text
    assert (
        'ito_run_resize_seconds{booking_id="bk_1",groups_after="3",groups_before="2",'
        'request_id="r-25",run_id="run_a"} 4.0'
    ) in text
    assert 'ito_run_badput_seconds{booking_id="bk_1",cause="resize",run_id="run_a"} 2.0' in text
    assert 'ito_run_gpu_hours{booking_id="bk_1",run_id="run_a"}' in text


@both_engines
def test_status_and_metrics_show_the_runs_resizes(db: str, tmp_path: Path) -> None:
    make_tenant(db, "acme", booking=booking_doc("bk-acme", "acme", node_count=2))
    store = Store(db)
    account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
    insert_run(store, "run_r", account_id=account_id, booking_id="bk-acme", state="running")
    outcome = {"stage": "parallelism", "status": "passed", "artifacts": {"plan": PLAN}}
    store.ingest_events("run_r", [{**StageResultEvent(outcome=outcome).model_dump(), "seq": 0}])
    sent: list[dict[str, Any]] = []
    resizer = Resizer(
        store, lambda run_id: "driver", lambda _h, request: sent.append(request), embedded_place
    )
    store.change_booking_nodes("bk-acme", "add", ["h3"])  # 4 -> 6 groups
    resizer.follow(store.runs_in_states(["running"]))
    store.change_booking_nodes("bk-acme", "add", ["h4"])  # 8 groups hold, 6 -> 8
    resizer.follow(store.runs_in_states(["running"]))
    store.change_booking_nodes("bk-acme", "add", ["h5"])  # 10 fit; the batch splits over 8
    resizer.follow(store.runs_in_states(["running"]))
    first = sent[0]["request_id"]
    now = store.run_resizes("run_r")[0]["requested_at"]
    # The trainer's reports, as its driver forwards them.
    reports = [
        StepEvent(
            ts=now - 1, step=9, loss=2.0, tokens=100, seconds=2.0, quorum_size=4, committed=True
        ),
        ResizeEvent(
            ts=now + 3.5,
            request_id=first,
            action="applied",
            groups_before=4,
            groups_after=6,
            step=10,
            seconds=3.5,
        ),
    ]
    store.ingest_events(
        "run_r", [{**ev.model_dump(mode="json"), "seq": i + 1} for i, ev in enumerate(reports)]
    )
    rows = store.run_view_rows("run_r")
    history = resize_history(rows.resize_events, rows.resizes)
    assert [(h["groups_before"], h["groups_after"], h["status"]) for h in history] == [
        (4, 6, "applied"),
        (6, 8, "delivered"),
        (8, 8, "refused"),
    ]
    assert history[0]["seconds"] == 3.5 and history[2]["code"] == "plan_resize_batch_not_divisible"
    text = render.run({**store.get_run("run_r"), "resizes": history})
    row = next(line for line in text.splitlines() if "4 -> 6" in line)
    assert "applied" in row and human.duration(3.5) in row and history[0]["requested_at"] in row
    assert "plan_resize_batch_not_divisible:" in text
    m = metrics_for(store, store.get_run("run_r"))
    assert m.replica_groups == 6 and m.badput_s["resize"] > 0
    assert m.gpu_hours is not None and m.gpu_cost_usd == pytest.approx(m.gpu_hours * 2.99, abs=1e-6)
    assert "4 -> 6" in render.metrics(m.model_dump(mode="json"))
