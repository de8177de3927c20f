"""Liveness. (The Prometheus scrape has its own listener: orchestrator/telemetry/listener.py.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from orchestrator.api.deps import Ctx, ctx
from orchestrator.api.envelope import Envelope, ok

router = APIRouter()


@router.get("/healthz", response_model=Envelope, tags=["health"])
def healthz(c: Ctx = Depends(ctx)) -> JSONResponse:
    return ok({"status": "ok", "schema_version": c.store.schema_version()})
