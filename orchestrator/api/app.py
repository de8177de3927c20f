"""The app factory: ``create_app(settings, runtime=None)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI

from orchestrator.api.bodycap import BodyCap
from orchestrator.api.deps import Ctx
from orchestrator.api.errors import install_handlers
from orchestrator.api.inputguard import InputGuard
from orchestrator.api.planbound import PlanBoundGate, PlanSlots
from orchestrator.api.ratelimit import RateLimit
from orchestrator.api.routes import bookings, confirmations, health, mutations, plans, runs
from orchestrator.db.store import Store
from orchestrator.runtime.interface import NullRuntime, RunRuntime
from orchestrator.settings import Settings, open_store
from orchestrator.telemetry.listener import MetricsListener
from orchestrator.telemetry.prometheus import render

API_VERSION = "1.0.0"


def create_app(
    settings: Settings, runtime: RunRuntime | None = None, store: Store | None = None
) -> FastAPI:
    store = store or open_store(settings)
    store.counted_window_s = settings.auth_fail_audit_window_s
    rt: RunRuntime = runtime if runtime is not None else NullRuntime(store, settings.var_dir)
    # Bound here, not at startup, so a taken port is refused (address_in_use) before the
    # server starts; the lifespan only starts and stops it.
    metrics = None
    if settings.metrics_port is not None:
        metrics = MetricsListener(
            lambda: render(store),
            settings.metrics_host,
            settings.metrics_port,
            settings.metrics_token,
        )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Sync handlers run in anyio's thread pool. With its default 40 threads, 50
        # polling clients share the GIL forty ways and every request waits ~40x its
        # own CPU time; a few threads keep requests first-come, first-served.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.request_threads
        if metrics is not None:
            metrics.start()
        rt.start()
        try:
            yield
        finally:
            if metrics is not None:
                metrics.stop()
            rt.stop()
            store.close()

    docs = settings.api_docs  # OpenAPI and docs pages only where the operator enables them
    app = FastAPI(
        title="ito-train API",
        version=API_VERSION,
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        description="Canonical API of the ito-train backend. Every response is an "
        "envelope {ok, live_api_contacted, notice, data | error}.",
    )
    slots = PlanSlots(settings.plans_in_flight_per_account, settings.plan_retry_after_s)
    app.state.ctx = Ctx(settings, store, rt, slots)
    app.state.metrics_address = metrics.address if metrics is not None else None
    install_handlers(app)

    # Inside the body cap: it scans the bounded body the cap has read.
    app.add_middleware(InputGuard, store=store)
    app.add_middleware(BodyCap, max_bytes=settings.max_body_bytes)
    # Outside the body cap: a plan request beyond its account's bound is not even read.
    app.add_middleware(PlanBoundGate, slots=slots, store=store)
    # Outermost: a refused flood costs neither a body read nor a handler thread.
    app.add_middleware(
        RateLimit,
        store=store,
        key_per_s=settings.rate_key_per_s,
        key_burst=settings.rate_key_burst,
        fail_per_s=settings.rate_auth_fail_per_s,
        fail_burst=settings.rate_auth_fail_burst,
    )
    for module in (health, bookings, confirmations, plans, runs, mutations):
        app.include_router(module.router)
    return app


def openapi_document(settings: Settings | None = None) -> str:
    """The OpenAPI document as committed in docs/openapi.json (sorted, indented)."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        s = settings or Settings(db_path=Path(tmp) / "openapi.db")
        app = create_app(s)
        doc = app.openapi()
        app.state.ctx.store.close()
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
