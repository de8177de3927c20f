"""The app factory: ``create_app(settings, runtime=None)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI

from orchestrator.api.bodycap import BodyCap
from orchestrator.api.deps import Ctx
from orchestrator.api.errors import install_handlers
from orchestrator.api.routes import bookings, confirmations, health, mutations, plans, runs
from orchestrator.db.store import Store
from orchestrator.runtime.interface import NullRuntime, RunRuntime
from orchestrator.settings import Settings

API_VERSION = "1.0.0"


def create_app(settings: Settings, runtime: RunRuntime | None = None,
               store: Store | None = None) -> FastAPI:
    store = store or Store(settings.db_path, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    rt: RunRuntime = runtime if runtime is not None else NullRuntime(store, settings.var_dir)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Sync handlers run in anyio's thread pool. With its default 40 threads, 50
        # polling clients share the GIL forty ways and every request waits ~40x its
        # own CPU time; a few threads keep requests first-come, first-served.
        anyio.to_thread.current_default_thread_limiter().total_tokens = (
            settings.request_threads)
        rt.start()
        try:
            yield
        finally:
            rt.stop()
            store.close()

    app = FastAPI(title="ito-train API", version=API_VERSION, lifespan=lifespan,
                  description="Canonical API of the ito-train backend. Every response is an "
                              "envelope {ok, live_api_contacted, notice, data | error}.")
    app.state.ctx = Ctx(settings, store, rt)
    install_handlers(app)

    app.add_middleware(BodyCap, max_bytes=settings.max_body_bytes)
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
