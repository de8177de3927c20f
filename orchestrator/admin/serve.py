"""``ito-backend serve``: the API server (uvicorn) on the store, with the run
supervisor on Ray (or no runtime: runs stay accepted)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.admin.common import DbOpt, fail
from orchestrator.runtime.interface import NullRuntime, RunRuntime
from orchestrator.settings import Settings, open_store
from stages.errors import ErrorCode, ItoError

# The server's own defaults (orchestrator/settings.py says why each is what it is).
_DEFAULTS = Settings.model_fields


def serve(
    db: DbOpt,
    host: str = "127.0.0.1",
    port: int = 8080,
    runtime: Annotated[
        str, typer.Option(help="ray (supervisor + RunDriver actors) or none (runs stay accepted)")
    ] = "ray",
    var_dir: Annotated[
        Path, typer.Option("--var-dir", envvar="ITO_VAR_DIR", help="run scratch space")
    ] = Path("/tmp/ito-var"),
    checkpoint_root: Annotated[
        list[Path] | None,
        typer.Option(
            "--checkpoint-root",
            help="allowed checkpoint storage root (repeatable); default: any absolute path",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            envvar="ITO_RAY_ADDRESS",
            help="join this Ray cluster; default: start/reuse the embedded local head",
        ),
    ] = None,
    ray_head_port: Annotated[int, typer.Option(help="embedded Ray head's GCS port")] = 6390,
    ray_dashboard_port: Annotated[int, typer.Option(help="embedded Ray dashboard port")] = 8265,
    ray_client_server_port: Annotated[
        int, typer.Option(help="embedded Ray head's Ray Client port")
    ] = 10001,
    ray_dashboard_agent_port: Annotated[
        int, typer.Option(help="embedded Ray head's dashboard agent HTTP port (0: any free)")
    ] = 52365,
    ray_num_cpus: Annotated[int | None, typer.Option(help="embedded Ray logical CPUs")] = None,
    max_active_runs_per_account: Annotated[
        int,
        typer.Option(
            help="active (queued or running) runs each account may have at once; one "
            "more is refused with too_many_active_runs"
        ),
    ] = 64,
    planner_gate: Annotated[
        bool,
        typer.Option(
            "--planner-gate/--no-planner-gate",
            help="refuse at submit what the "
            "parallelism planner refuses, and price from its step time",
        ),
    ] = True,
    metrics_host: Annotated[
        str, typer.Option(help="the Prometheus scrape's own listener (never the API socket)")
    ] = "127.0.0.1",
    metrics_port: Annotated[
        int, typer.Option(help="its port (0: pick a free one, printed at start)")
    ] = 9464,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(help="require 'Authorization: Bearer <token>' from this 0600 file"),
    ] = None,
    api_docs: Annotated[
        bool, typer.Option("--api-docs/--no-api-docs", help="serve /openapi.json, /docs, /redoc")
    ] = False,
    shutdown_grace_s: Annotated[
        float, typer.Option(help="on SIGTERM, seconds in-flight requests may take before exit")
    ] = 10.0,
    max_connections: Annotated[
        int,
        typer.Option(
            help="open client connections at most (clamped to the descriptor limit); at "
            "the cap the oldest one still waiting for a request is closed for a new one"
        ),
    ] = _DEFAULTS["max_connections"].default,
    header_timeout: Annotated[
        float, typer.Option(help="seconds a connection has to send a complete request head")
    ] = _DEFAULTS["header_timeout_s"].default,
    body_timeout: Annotated[
        float, typer.Option(help="seconds a request has to send its whole body")
    ] = _DEFAULTS["body_timeout_s"].default,
    plans_per_account: Annotated[
        int,
        typer.Option(
            help="plan validations one account may have in flight; beyond: 429 "
            "too_many_concurrent_plans"
        ),
    ] = _DEFAULTS["plans_in_flight_per_account"].default,
    log_level: str = "info",
) -> None:
    """Run the API server (uvicorn) on the store at --db."""
    if runtime == "ray":
        import orchestrator.runtime.ray_cluster  # noqa: F401 - configures Ray's token auth first
    from orchestrator.api import create_app
    from orchestrator.api.serving import build_server

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    from orchestrator.telemetry.listener import read_token

    settings = Settings(
        db_path=db,
        var_dir=var_dir,
        planner_gate=planner_gate,
        checkpoint_roots=tuple(checkpoint_root or ()),
        max_active_runs_per_account=max_active_runs_per_account,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        metrics_token=read_token(metrics_token_file),
        api_docs=api_docs,
        shutdown_grace_s=shutdown_grace_s,
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        plans_in_flight_per_account=plans_per_account,
    )
    store = open_store(settings)
    logging.getLogger("ito.api").info("store: %s (%s)", store.describe(), store.dialect)
    rt: RunRuntime
    if runtime == "none":
        rt = NullRuntime(store, var_dir)
    elif runtime == "ray":
        from orchestrator.runtime.ray_cluster import RaySettings
        from orchestrator.runtime.supervisor import RayRuntime
        from orchestrator.runtime.supervisor_settings import SupervisorSettings

        supervisor = SupervisorSettings.from_env().model_copy(
            update={
                "checkpoint_roots": tuple(os.path.realpath(r) for r in settings.checkpoint_roots)
            }
        )
        rt = RayRuntime(
            store,
            var_dir,
            RaySettings(
                address=ray_address,
                head_port=ray_head_port,
                dashboard_port=ray_dashboard_port,
                client_server_port=ray_client_server_port,
                dashboard_agent_listen_port=ray_dashboard_agent_port,
                num_cpus=ray_num_cpus,
            ),
            settings=supervisor,
        )
    else:
        fail(False, ErrorCode.bad_request, f"unknown runtime {runtime!r} (known: ray, none)")
    from orchestrator.redact import AccessLogRedactor

    try:
        app = create_app(settings, rt, store)
    except ItoError as e:
        fail(False, e.code, e.message)
    if app.state.metrics_address is not None:
        m_host, m_port = app.state.metrics_address
        # With --metrics-port 0 this is the only place the chosen port is told.
        print(f"metrics listener on http://{m_host}:{m_port}/metrics", file=sys.stderr, flush=True)
    server = build_server(app, settings, host=host, port=port, log_level=log_level)
    # uvicorn configures its loggers in Config(); the filter goes on afterwards.
    logging.getLogger("uvicorn.access").addFilter(AccessLogRedactor())
    server.run()
