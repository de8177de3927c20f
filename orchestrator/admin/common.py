"""What every ``ito-backend`` command shares: the ``--db`` and ``--json`` options, one
envelope (or plain lines) out, a refusal with its code, and the audit row each
operator action leaves (ids only)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any, NoReturn

import typer

from orchestrator.db.store import Store
from stages.errors import ErrorCode

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


def emit(as_json: bool, data: dict[str, Any], notice: str) -> None:
    if as_json:
        print(json.dumps({"ok": True, "live_api_contacted": False, "notice": notice, "data": data}))
    else:
        print(notice)
        for k, v in data.items():
            print(f"  {k}: {v}")


def fail(as_json: bool, code: ErrorCode, message: str) -> NoReturn:
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


def store_at(db: str) -> Store:
    return Store(db)


def audit(
    db: str,
    action: str,
    account_id: str | None = None,
    key_id: str | None = None,
    booking_id: str | None = None,
    run_id: str | None = None,
    code: str | None = None,
) -> None:
    """Operator actions are audit events too (ids only)."""
    store_at(db).audit(
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
