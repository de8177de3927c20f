"""A run's metrics from its stored events: ``orchestrator.telemetry.goodput`` over the store.

The same numbers serve ``GET /v1/runs/{id}/metrics``, ``ito metrics`` and the
Prometheus families at ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from orchestrator.db.store import Row, Store
from orchestrator.gates.costing import price_per_gpu_hour, usage_cost_usd
from orchestrator.gates.planning import plan_ranks, run_plan
from orchestrator.runs import TERMINAL, RunState
from orchestrator.telemetry.goodput import RunMetrics, compute_run_metrics
from stages.errors import ItoError
from stages.presets import configs_dir


@dataclass(frozen=True)
class RunSample:
    """One run's telemetry as a scrape exports it."""

    run_id: str
    booking_id: str
    state: str
    metrics: RunMetrics


TELEMETRY_KINDS = (
    "step",
    "phase",
    "interruption",
    "checkpoint",
    "progress",
    "eval",
    "metrics",
    "resize",
)


def metrics_for(store: Store, run: Row) -> RunMetrics:
    events = store.list_events(run["run_id"], kinds=TELEMETRY_KINDS, limit=10_000_000)
    # A finished run's clock stopped when it finished (a cleaned run: at its last
    # event, since cleanup moved updated_at); a live one's runs on.
    state = RunState(run["state"])
    if state in TERMINAL:
        now = run["updated_at"]
    elif state == RunState.cleaned:
        now = max([e["ts"] for e in events[-1:]] or [run["created_at"]])
    else:
        now = time.time()
    plan = run_plan(store, run)
    m = compute_run_metrics(
        (e["payload"] for e in events),
        started_at=run["created_at"],
        now=now,
        planned_groups=None if plan is None else int(plan["dp_replicate"]),
        ranks_per_group=None if plan is None else plan_ranks(plan),
    )
    booking = store.booking(run["booking_id"])
    if m.gpu_hours is not None and booking is not None and booking["gpu_sku"]:
        try:
            price = price_per_gpu_hour(configs_dir(), booking["gpu_sku"])
        except ItoError:  # an SKU without a price: the hours alone
            return m
        m.gpu_cost_usd = usage_cost_usd(m.gpu_hours, price)
    return m


def run_metrics(store: Store, run_id: str) -> dict[str, Any]:
    return metrics_for(store, store.get_run(run_id)).model_dump(mode="json")


# Finished runs' metrics never change: a scrape recomputes only live runs.
_finished: dict[tuple[str, float], RunMetrics] = {}


def samples(store: Store) -> Iterator[RunSample]:
    """Every run's telemetry, for the Prometheus collector."""
    for run in store.read("SELECT * FROM runs ORDER BY created_at"):
        key = (run["run_id"], run["updated_at"])
        m = _finished.get(key)
        if m is None:
            m = metrics_for(store, run)
            if RunState(run["state"]) in TERMINAL:
                _finished[key] = m
        yield RunSample(run["run_id"], run["booking_id"], run["state"], m)
