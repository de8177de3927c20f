"""Request plumbing shared by the routes: app context, gate trail, views."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orchestrator.api.objective_gates import objective_gates
from orchestrator.db.store import Row, Store
from orchestrator.gates.auth import Principal, authenticate, sha256_hex
from orchestrator.gates.bookings import iso
from orchestrator.redact import looks_secret, safe_id
from orchestrator.runtime.interface import RunRuntime
from orchestrator.settings import Settings
from orchestrator.telemetry.resizes import resize_history
from stages.errors import ErrorCode, ItoError

T = TypeVar("T")
bearer = HTTPBearer(auto_error=False, description="itok_<key_id>_<secret>")
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:-]{8,128}$")
# Refusals audited as counted rows (Store.audit_counted), like the rate limits'.
COUNTED_REFUSALS = (ErrorCode.too_many_concurrent_plans,)


@dataclass
class Ctx:
    settings: Settings
    store: Store
    runtime: RunRuntime
    # Plan validations in flight per account (orchestrator/api/gating.py).
    plan_slots: Any = None


def ctx(request: Request) -> Ctx:
    c: Ctx = request.app.state.ctx
    return c


@dataclass
class Gates:
    """Runs gates in order and records each decision as an audit row (ids and codes only).

    The rows are written in one transaction when the request ends."""

    store: Store
    action: str
    booking_id: str | None = None
    run_id: str | None = None
    principal: Principal | None = None
    # Reads record only refusals, so that polling never writes the store.
    audit_passes: bool = True
    rows: list[Row] = field(default_factory=list)

    def __enter__(self) -> Gates:
        return self

    def __exit__(self, _type: object, exc: object, _tb: object) -> None:
        if isinstance(exc, ItoError) and exc.code == ErrorCode.store_unavailable:
            return  # the rows cannot be written; the request answers 503 as it is
        if isinstance(exc, ItoError) and exc.code in COUNTED_REFUSALS:
            # A refusal for load comes in bursts: one counted row per window, not a
            # write transaction (and an fsync) per refused request.
            self.store.audit_counted(self.action, str(exc.code), gate="load")
            return
        self.store.audit(self.rows)

    def record(self, gate: str, ok: bool, code: str | None = None) -> None:
        if ok and not self.audit_passes:
            return
        if gate == "auth" and not ok and self.principal is None:
            # An unauthenticated failure: no write transaction of its own (a flood of
            # bad keys must not serialise real writes); one counted row per window.
            self.store.audit_counted(self.action, str(code))
            return
        self.rows.append(
            {
                "ts": time.time(),
                "account_id": self.principal.account_id if self.principal else None,
                "key_id": self.principal.key_id if self.principal else None,
                "action": self.action,
                "gate": gate,
                "outcome": "pass" if ok else "fail",
                "code": code,
                "booking_id": safe_id(self.booking_id),
                "run_id": safe_id(self.run_id),
            }
        )

    def check(self, gate: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            result = fn(*args, **kwargs)
        except ItoError as e:
            self.record(gate, False, str(e.code))
            raise
        self.record(gate, True)
        return result

    def auth(
        self, creds: HTTPAuthorizationCredentials | None, scope: str, *alternatives: str
    ) -> Principal:
        def _auth() -> Principal:
            header = f"Bearer {creds.credentials}" if creds else None
            p = authenticate(self.store, header)
            self.principal = p
            p.require(scope, *alternatives)
            return p

        return self.check("auth", _auth)


def idempotency_key(value: str | None) -> str:
    if not value:
        raise ItoError(ErrorCode.idempotency_key_missing, "an Idempotency-Key header is required")
    if not IDEMPOTENCY_KEY.match(value) or looks_secret(value):
        raise ItoError(
            ErrorCode.idempotency_key_invalid,
            "Idempotency-Key must be 8-128 characters of [A-Za-z0-9._:-]",
        )
    return value


def fingerprint(*parts: str | None) -> str:
    """What makes two requests "the same" for idempotency."""
    return sha256_hex(json.dumps([p or "" for p in parts]))


def _loads(value: str | None) -> Any:
    return None if value is None else json.loads(value)


def run_view(store: Store, run_id: str, owner: Principal | None = None) -> dict[str, Any]:
    """The run as the API shows it, from one batch of reads (``Store.run_view_rows``).
    With ``owner`` (the caller) another account's run is ``run_not_found``, and the
    account's name needs no lookup of its own."""
    rows = store.run_view_rows(run_id, owner.account_id if owner else None)
    run = rows.run
    if owner is not None:
        name: str | None = owner.account_name
    else:
        account = store.account(run["account_id"])
        name = account["name"] if account else None
    gates = eval_gates(rows.eval_events)
    return {
        "run_id": run["run_id"],
        "booking_id": run["booking_id"],
        "account": name,
        "manifest_id": run["manifest_id"],
        "manifest_digest": run["manifest_digest"],
        "idempotency_key": run["idempotency_key"],
        "state": run["state"],
        "state_reason": run["state_reason"],
        "created_at": iso(run["created_at"]),
        "updated_at": iso(run["updated_at"]),
        "cost_estimate_usd": run["cost_estimate_usd"],
        "stage_gates": [
            {
                "stage": g["stage"],
                "status": g["status"],
                "reason": g["reason"],
                "metrics": json.loads(g["metrics"]),
                "error_code": g["error_code"],
            }
            for g in rows.stage_gates
        ],
        "proposals": [
            {
                "proposal_id": p["proposal_id"],
                "action": p["action"],
                "description": p["description"],
                "params": json.loads(p["params"]),
                "status": p["status"],
            }
            for p in rows.proposals
        ],
        "plan": _loads(run["plan"]),
        "data_prep": _loads(run["data_prep"]),
        # The latest progress of a long stage step (data prep over a corpus), or None.
        "stage_progress": rows.progress,
        "eval_gates": gates,
        # Each post-training objective the manifest names: its gate, and its verdict once
        # decided (the checks are its eval_gates entry).
        "post_training_gates": [g.model_dump(mode="json") for g in objective_gates(run, gates)],
        # Its replica groups following its booking's nodes (orchestrator/runtime/resizing.py).
        "resizes": resize_history(rows.resize_events, rows.resizes),
    }


def eval_gates(events: list[Row]) -> list[dict[str, Any]]:
    """Each curriculum phase's gate with every check's score, bounds and verdict, from
    the run's ``eval`` events (so a live run shows the phases decided so far)."""
    phases: dict[str, dict[str, Any]] = {}
    for ev in events:
        b = ev["payload"]
        ph = phases.setdefault(
            b["phase"],
            {
                "phase": b["phase"],
                "battery": b["battery"],
                "step": b.get("step"),
                "passed": True,
                "checks": [],
            },
        )
        ph["passed"] = ph["passed"] and bool(b["passed"])
        ph["checks"].append(
            {
                k: b.get(k)
                for k in (
                    "check",
                    "score",
                    "passed",
                    "reason",
                    "min",
                    "max",
                    "max_regression",
                    "previous",
                )
            }
        )
    return list(phases.values())
