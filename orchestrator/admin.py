"""``ito-backend``: the API server and its admin commands (operators only).

Admin commands write the store directly (same host as the server, ``--db`` or
``ITO_DB``); with ``--json`` each prints one envelope. ``keys issue`` prints the
key exactly once; only its hash is stored.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from orchestrator.db.store import Store
from orchestrator.gates.auth import issue_key
from orchestrator.gates.bookings import BookingFile, add_booking, booking_view, change_nodes
from orchestrator.redact import looks_secret
from orchestrator.runs import RunState
from orchestrator.runtime.interface import NullRuntime, RunRuntime
from orchestrator.settings import Settings, open_store
from stages.errors import ErrorCode, ItoError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="ito-train backend: API server and admin commands",
)
accounts_app = typer.Typer(no_args_is_help=True, help="Tenant accounts")
keys_app = typer.Typer(no_args_is_help=True, help="API keys (stored as sha256 only)")
bookings_app = typer.Typer(no_args_is_help=True, help="The booking registry")
runs_app = typer.Typer(no_args_is_help=True, help="Runs (any account's)")
app.add_typer(accounts_app, name="accounts")
app.add_typer(keys_app, name="keys")
app.add_typer(bookings_app, name="bookings")
app.add_typer(runs_app, name="runs")

DbOpt = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="ITO_DB",
        help="the store: a SQLite file path, or a postgresql:// URL "
        "without a password (ITO_DB_PASSWORD_FILE, PGPASSWORD or PGPASSFILE carry it)",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON envelope")]
# The server's own defaults (orchestrator/settings.py says why each is what it is).
_DEFAULTS = Settings.model_fields


def _emit(as_json: bool, data: dict[str, Any], notice: str) -> None:
    if as_json:
        print(json.dumps({"ok": True, "live_api_contacted": False, "notice": notice, "data": data}))
    else:
        print(notice)
        for k, v in data.items():
            print(f"  {k}: {v}")


def _fail(as_json: bool, code: ErrorCode, message: str) -> NoReturn:
    if as_json:
        print(
            json.dumps(
                {
                    "ok": False,
                    "live_api_contacted": False,
                    "notice": f"refused: {code}",
                    "error": {"code": str(code), "message": message},
                }
            )
        )
    else:
        print(f"error [{code}]: {message}", file=sys.stderr)
    raise typer.Exit(1)


def _store(db: str) -> Store:
    return Store(db)


def _audit(
    db: str,
    action: str,
    account_id: str | None = None,
    key_id: str | None = None,
    booking_id: str | None = None,
    run_id: str | None = None,
    code: str | None = None,
) -> None:
    """Operator actions are audit events too (ids only)."""
    _store(db).audit(
        [
            {
                "ts": time.time(),
                "account_id": account_id,
                "key_id": key_id,
                "action": f"admin:{action}",
                "gate": "operator",
                "outcome": "pass",
                "code": code,
                "booking_id": booking_id,
                "run_id": run_id,
            }
        ]
    )


@app.command()
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
        _fail(False, ErrorCode.bad_request, f"unknown runtime {runtime!r} (known: ray, none)")
    from orchestrator.redact import AccessLogRedactor

    try:
        app = create_app(settings, rt, store)
    except ItoError as e:
        _fail(False, e.code, e.message)
    if app.state.metrics_address is not None:
        m_host, m_port = app.state.metrics_address
        # With --metrics-port 0 this is the only place the chosen port is told.
        print(f"metrics listener on http://{m_host}:{m_port}/metrics", file=sys.stderr, flush=True)
    server = build_server(app, settings, host=host, port=port, log_level=log_level)
    # uvicorn configures its loggers in Config(); the filter goes on afterwards.
    logging.getLogger("uvicorn.access").addFilter(AccessLogRedactor())
    server.run()


@accounts_app.command("create")
def accounts_create(name: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    try:
        row = _store(db).create_account(name)
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    _audit(db, "accounts.create", account_id=row["account_id"])
    _emit(as_json, {"account_id": row["account_id"], "name": name}, f"account {name} created")


@accounts_app.command("disable")
def accounts_disable(name: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    """Disable an account: its keys stop working, and so do the confirmations they made."""
    store = _store(db)
    row = store.account_by_name(name)
    if row is None or not store.disable_account(name):
        _fail(as_json, ErrorCode.not_found, f"no enabled account {name!r}")
    _audit(db, "accounts.disable", account_id=row["account_id"])
    _emit(as_json, {"account": name, "disabled": True}, f"account {name} disabled")


def canonical_root(raw: Path) -> str:
    """An operator root: absolute, canonical (no '..', '//', trailing '/'), an existing
    folder; symlinks in it are resolved once, here, by the operator's hand."""
    text = str(raw)
    if not raw.is_absolute() or os.path.normpath(text) != text or "\x00" in text:
        raise ItoError(ErrorCode.bad_request, "a root must be a canonical absolute path")
    real = os.path.realpath(text)
    if not os.path.isdir(real):
        raise ItoError(ErrorCode.bad_request, "a root must be an existing folder")
    return real


@accounts_app.command("roots")
def accounts_roots(
    name: str,
    db: DbOpt,
    data: Annotated[
        list[Path] | None,
        typer.Option(
            "--data",
            help="data root (repeatable): data.refs, eval_files and cache_dir must lie inside one",
        ),
    ] = None,
    checkpoint: Annotated[
        list[Path] | None, typer.Option("--checkpoint", help="checkpoint root (repeatable)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Set (replace) an account's data and/or checkpoint roots; with neither, show them.

    An account without roots of a kind can reference nothing of that kind."""
    store = _store(db)
    row = store.account_by_name(name)
    if row is None:
        _fail(as_json, ErrorCode.not_found, f"no account {name!r}")
    try:
        for kind, paths in (("data", data), ("checkpoint", checkpoint)):
            if paths is not None:
                store.set_roots(row["account_id"], kind, sorted({canonical_root(p) for p in paths}))
                _audit(db, f"accounts.roots.{kind}", account_id=row["account_id"])
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    _emit(
        as_json,
        {
            "account": name,
            "data_roots": list(store.roots(row["account_id"], "data")),
            "checkpoint_roots": list(store.roots(row["account_id"], "checkpoint")),
        },
        f"roots of {name}",
    )


@keys_app.command("issue")
def keys_issue(
    db: DbOpt,
    account: Annotated[str, typer.Option(help="account name")],
    scope: Annotated[list[str], typer.Option(help="repeatable or comma-separated")],
    as_json: JsonOpt = False,
) -> None:
    scopes = sorted({s.strip() for item in scope for s in item.split(",") if s.strip()})
    try:
        key_id, key = issue_key(_store(db), account, scopes)
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    _audit(db, "keys.issue", key_id=key_id)
    _emit(
        as_json,
        {"key_id": key_id, "api_key": key, "account": account, "scopes": scopes},
        "key issued; it is shown once and stored only as a hash",
    )


@keys_app.command("revoke")
def keys_revoke(key_id: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    if not _store(db).revoke_key(key_id):
        _fail(as_json, ErrorCode.not_found, f"no active key {key_id}")
    _audit(db, "keys.revoke", key_id=key_id)
    _emit(as_json, {"key_id": key_id, "revoked": True}, f"key {key_id} revoked")


@bookings_app.command("add")
def bookings_add(file: Path, db: DbOpt, as_json: JsonOpt = False) -> None:
    try:
        booking = BookingFile.model_validate_json(file.read_bytes())
        view = add_booking(_store(db), booking)
    except OSError as e:
        _fail(as_json, ErrorCode.bad_request, f"cannot read {file}: {e.strerror}")
    except ValidationError as e:
        msgs = "; ".join(
            f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors(include_input=False)
        )
        _fail(as_json, ErrorCode.validation_error, msgs)
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    _audit(db, "bookings.add", booking_id=booking.booking_id)
    _emit(as_json, view, f"booking {booking.booking_id} added")


def _set_booking(db: str, booking_id: str, state: str, as_json: bool) -> None:
    store = _store(db)
    try:
        store.set_booking_state(booking_id, state)
        view = booking_view(store, booking_id)
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    _audit(db, f"bookings.{state}", booking_id=booking_id)
    _emit(as_json, view, f"booking {booking_id} {state}")


@bookings_app.command("revoke")
def bookings_revoke(booking_id: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    _set_booking(db, booking_id, "revoked", as_json)


@bookings_app.command("release")
def bookings_release(booking_id: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    _set_booking(db, booking_id, "released", as_json)


NodesOpt = Annotated[
    list[str] | None,
    typer.Option("--node", help="a node's name (repeatable)", show_default=False),
]


def _change_nodes(db: str, booking_id: str, action: str, nodes: list[str], as_json: bool) -> None:
    try:
        view = change_nodes(_store(db), booking_id, action, nodes)
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    verb = "added to" if action == "add" else "removed from"
    _audit(db, f"bookings.{action}_nodes", booking_id=booking_id)
    _emit(as_json, view, f"{len(nodes)} node(s) {verb} booking {booking_id}")


@bookings_app.command("add-nodes")
def bookings_add_nodes(
    booking_id: str, db: DbOpt, node: NodesOpt = None, as_json: JsonOpt = False
) -> None:
    """Add nodes to an active booking: its running run grows into them (at the
    supervisor's next authority check). A node of another active booking is refused."""
    _change_nodes(db, booking_id, "add", node or [], as_json)


@bookings_app.command("remove-nodes")
def bookings_remove_nodes(
    booking_id: str, db: DbOpt, node: NodesOpt = None, as_json: JsonOpt = False
) -> None:
    """Take nodes back from an active booking: its running run's groups on them leave
    at a step boundary (below one replica group the run pauses, ``paused_capacity``)."""
    _change_nodes(db, booking_id, "remove", node or [], as_json)


MAX_STOP_REASON = 500


@runs_app.command("stop")
def runs_stop(
    run_id: str,
    db: DbOpt,
    reason: Annotated[
        str, typer.Option(help="why; kept in the run's state reason and logs (no secrets)")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Stop any account's run, queued or running: it goes to ``cancelling`` with code
    ``operator_stopped``, and the server's supervisor tears its driver and fleet down
    (ending ``cancelled``). Audited."""
    why = " ".join(reason.split())  # one line: it lands in logs a tenant reads
    if not why or len(why) > MAX_STOP_REASON or not why.isprintable() or looks_secret(why):
        _fail(
            as_json,
            ErrorCode.bad_request,
            f"--reason must be 1-{MAX_STOP_REASON} printable characters, no secrets",
        )
    store = _store(db)
    try:
        run = store.get_run(run_id)
        # The transition table refuses a run that is already stopping or has ended.
        store.transition(run_id, RunState.cancelling, f"{ErrorCode.operator_stopped}: {why}")
    except ItoError as e:
        _fail(as_json, e.code, e.message)
    _audit(
        db,
        "runs.stop",
        account_id=run["account_id"],
        booking_id=run["booking_id"],
        run_id=run_id,
        code=str(ErrorCode.operator_stopped),
    )
    _emit(
        as_json,
        {
            "run_id": run_id,
            "state": str(RunState.cancelling),
            "state_reason": f"{ErrorCode.operator_stopped}: {why}",
        },
        f"run {run_id} is stopping",
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
