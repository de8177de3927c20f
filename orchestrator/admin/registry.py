"""The operator's registry commands: accounts (and their roots), API keys, bookings
(and their nodes), and stopping any account's run. Each writes the store directly
and leaves an audit row."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from orchestrator.admin.common import DbOpt, JsonOpt, audit, emit, fail, store_at
from orchestrator.gates.auth import issue_key
from orchestrator.gates.bookings import BookingFile, add_booking, booking_view, change_nodes
from orchestrator.redact import looks_secret
from orchestrator.runs import RunState
from stages.errors import ErrorCode, ItoError

accounts_app = typer.Typer(no_args_is_help=True, help="Tenant accounts")
keys_app = typer.Typer(no_args_is_help=True, help="API keys (stored as sha256 only)")
bookings_app = typer.Typer(no_args_is_help=True, help="The booking registry")
runs_app = typer.Typer(no_args_is_help=True, help="Runs (any account's)")


@accounts_app.command("create")
def accounts_create(name: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    try:
        row = store_at(db).create_account(name)
    except ItoError as e:
        fail(as_json, e.code, e.message)
    audit(db, "accounts.create", account_id=row["account_id"])
    emit(as_json, {"account_id": row["account_id"], "name": name}, f"account {name} created")


@accounts_app.command("disable")
def accounts_disable(name: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    """Disable an account: its keys stop working, and so do the confirmations they made."""
    store = store_at(db)
    row = store.account_by_name(name)
    if row is None or not store.disable_account(name):
        fail(as_json, ErrorCode.not_found, f"no enabled account {name!r}")
    audit(db, "accounts.disable", account_id=row["account_id"])
    emit(as_json, {"account": name, "disabled": True}, f"account {name} disabled")


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
    store = store_at(db)
    row = store.account_by_name(name)
    if row is None:
        fail(as_json, ErrorCode.not_found, f"no account {name!r}")
    try:
        for kind, paths in (("data", data), ("checkpoint", checkpoint)):
            if paths is not None:
                store.set_roots(row["account_id"], kind, sorted({canonical_root(p) for p in paths}))
                audit(db, f"accounts.roots.{kind}", account_id=row["account_id"])
    except ItoError as e:
        fail(as_json, e.code, e.message)
    emit(
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
        key_id, key = issue_key(store_at(db), account, scopes)
    except ItoError as e:
        fail(as_json, e.code, e.message)
    audit(db, "keys.issue", key_id=key_id)
    emit(
        as_json,
        {"key_id": key_id, "api_key": key, "account": account, "scopes": scopes},
        "key issued; it is shown once and stored only as a hash",
    )


@keys_app.command("revoke")
def keys_revoke(key_id: str, db: DbOpt, as_json: JsonOpt = False) -> None:
    if not store_at(db).revoke_key(key_id):
        fail(as_json, ErrorCode.not_found, f"no active key {key_id}")
    audit(db, "keys.revoke", key_id=key_id)
    emit(as_json, {"key_id": key_id, "revoked": True}, f"key {key_id} revoked")


@bookings_app.command("add")
def bookings_add(file: Path, db: DbOpt, as_json: JsonOpt = False) -> None:
    try:
        booking = BookingFile.model_validate_json(file.read_bytes())
        view = add_booking(store_at(db), booking)
    except OSError as e:
        fail(as_json, ErrorCode.bad_request, f"cannot read {file}: {e.strerror}")
    except ValidationError as e:
        msgs = "; ".join(
            f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors(include_input=False)
        )
        fail(as_json, ErrorCode.validation_error, msgs)
    except ItoError as e:
        fail(as_json, e.code, e.message)
    audit(db, "bookings.add", booking_id=booking.booking_id)
    emit(as_json, view, f"booking {booking.booking_id} added")


def _set_booking(db: str, booking_id: str, state: str, as_json: bool) -> None:
    store = store_at(db)
    try:
        store.set_booking_state(booking_id, state)
        view = booking_view(store, booking_id)
    except ItoError as e:
        fail(as_json, e.code, e.message)
    audit(db, f"bookings.{state}", booking_id=booking_id)
    emit(as_json, view, f"booking {booking_id} {state}")


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
        view = change_nodes(store_at(db), booking_id, action, nodes)
    except ItoError as e:
        fail(as_json, e.code, e.message)
    verb = "added to" if action == "add" else "removed from"
    audit(db, f"bookings.{action}_nodes", booking_id=booking_id)
    emit(as_json, view, f"{len(nodes)} node(s) {verb} booking {booking_id}")


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
        fail(
            as_json,
            ErrorCode.bad_request,
            f"--reason must be 1-{MAX_STOP_REASON} printable characters, no secrets",
        )
    store = store_at(db)
    try:
        run = store.get_run(run_id)
        # The transition table refuses a run that is already stopping or has ended.
        store.transition(run_id, RunState.cancelling, f"{ErrorCode.operator_stopped}: {why}")
    except ItoError as e:
        fail(as_json, e.code, e.message)
    audit(
        db,
        "runs.stop",
        account_id=run["account_id"],
        booking_id=run["booking_id"],
        run_id=run_id,
        code=str(ErrorCode.operator_stopped),
    )
    emit(
        as_json,
        {
            "run_id": run_id,
            "state": str(RunState.cancelling),
            "state_reason": f"{ErrorCode.operator_stopped}: {why}",
        },
        f"run {run_id} is stopping",
    )
