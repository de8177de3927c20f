"""Liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from orchestrator.api.deps import Ctx, ctx
from orchestrator.api.envelope import Envelope, ok
from orchestrator.runs import RunState
from orchestrator.telemetry.metrics_view import samples
from orchestrator.telemetry.prometheus import TelemetryCollector

router = APIRouter()


@router.get("/healthz", response_model=Envelope, tags=["health"])
def healthz(c: Ctx = Depends(ctx)) -> JSONResponse:
    return ok({"status": "ok", "schema_version": c.store.schema_version()})


@router.get("/metrics", include_in_schema=False)
def prometheus(c: Ctx = Depends(ctx)) -> Response:
    """Prometheus text (not an envelope): run counts, gate failures, and per-run and
    per-booking goodput telemetry (docs/runtime.md)."""
    registry = CollectorRegistry()
    runs = Gauge("ito_runs", "Runs by state", ["state"], registry=registry)
    counts = {r["state"]: r["n"] for r in c.store.read(
        "SELECT state, COUNT(*) AS n FROM runs GROUP BY state")}
    for state in RunState:
        runs.labels(state=str(state)).set(counts.get(str(state), 0))
    fails = Gauge("ito_gate_failures", "Gate failures by code (since the store was created)",
                  ["code"], registry=registry)
    for r in c.store.read("SELECT code, COUNT(*) AS n FROM audit_events WHERE outcome = 'fail' "
                          "GROUP BY code"):
        fails.labels(code=str(r["code"])).set(r["n"])
    registry.register(TelemetryCollector(lambda: samples(c.store)))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
