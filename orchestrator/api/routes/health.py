"""Liveness and readiness. (The Prometheus scrape has its own listener:
orchestrator/telemetry/listener.py.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from orchestrator.api.deps import Ctx, ctx
from orchestrator.api.envelope import Envelope, ok
from orchestrator.db.engines import unavailable
from orchestrator.db.schema import SCHEMA_VERSION
from stages.errors import ItoError

router = APIRouter()


@router.get("/healthz", response_model=Envelope, tags=["health"])
async def healthz() -> JSONResponse:
    """Live while the process serves HTTP. It never touches the store (nor a handler
    thread): a database blip must not make a liveness probe restart healthy replicas.
    ``schema_version`` is the code's (the store was migrated to it at start)."""
    return ok({"status": "ok", "schema_version": SCHEMA_VERSION})


@router.get("/readyz", response_model=Envelope, tags=["health"])
def readyz(c: Ctx = Depends(ctx)) -> JSONResponse:
    """Ready while this replica reaches its store: a load balancer sends it traffic.
    Not ready: 503 store_unavailable with Retry-After."""
    try:
        version = c.store.schema_version()
    except ItoError:
        raise
    except Exception as e:
        raise unavailable(c.settings.store, "the store is unreachable") from e
    return ok({"status": "ready", "schema_version": version})
