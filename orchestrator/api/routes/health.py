"""Liveness and readiness. (The Prometheus scrape has its own listener:
orchestrator/telemetry/listener.py.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from orchestrator.api.deps import Ctx, ctx
from orchestrator.api.envelope import Envelope, ok
from stages.errors import ErrorCode, ItoError

router = APIRouter()


@router.get("/healthz", response_model=Envelope, tags=["health"])
def healthz(c: Ctx = Depends(ctx)) -> JSONResponse:
    return ok({"status": "ok", "schema_version": c.store.schema_version()})


@router.get("/readyz", response_model=Envelope, tags=["health"])
def readyz(c: Ctx = Depends(ctx)) -> JSONResponse:
    """Ready while this replica reaches its store: a load balancer sends it traffic."""
    try:
        version = c.store.schema_version()
    except Exception:
        raise ItoError(ErrorCode.store_unavailable, "the store is unreachable") from None
    return ok({"status": "ready", "schema_version": version})
