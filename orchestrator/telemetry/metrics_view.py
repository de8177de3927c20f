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
from orchestrator.runs import TERMINAL, RunState
from orchestrator.telemetry.goodput import RunMetrics, compute_run_metrics


@dataclass(frozen=True)
class RunSample:
    """One run's telemetry as a scrape exports it."""

    run_id: str
    booking_id: str
    state: str
    metrics: RunMetrics


TELEMETRY_KINDS = ("step", "phase", "interruption", "checkpoint", "progress", "eval", "metrics")


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
    return compute_run_metrics(
        (e["payload"] for e in events), started_at=run["created_at"], now=now
    )


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
