"""Runs: submit (every gate, then one transaction), read, logs, metrics, checkpoints."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from orchestrator.api.deps import (
    Ctx,
    Gates,
    bearer,
    ctx,
    fingerprint,
    idempotency_key,
    run_view,
)
from orchestrator.api.envelope import Envelope, ok
from orchestrator.api.gating import (
    booking_gate,
    manifest_gate,
    validation_gate,
)
from orchestrator.api.models import RunRequest
from orchestrator.api.planbound import plan_slot
from orchestrator.db.store import Conn, Row, Store, new_id
from orchestrator.gates import confirmations
from orchestrator.gates.auth import Principal
from orchestrator.gates.bookings import iso
from orchestrator.runs import RunState
from orchestrator.telemetry.metrics_view import run_metrics
from stages.errors import ErrorCode, ItoError

log = logging.getLogger("ito.api")
router = APIRouter(tags=["runs"])


def _replay(c: Ctx, run: Row, request_sha: str) -> JSONResponse:
    if run["request_sha256"] != request_sha:
        raise ItoError(
            ErrorCode.idempotency_conflict, "this Idempotency-Key was used for a different request"
        )
    return ok(
        {**run_view(c.store, run["run_id"]), "replayed": True},
        notice=f"replayed: run {run['run_id']} already exists for this key",
    )


@router.post("/v1/runs", response_model=Envelope)
def submit_run(
    body: RunRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    key_header: str | None = Header(default=None, alias="Idempotency-Key"),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    store = c.store
    with Gates(store, "train", booking_id=body.booking_id) as g:
        p = g.auth(creds, "runs:write")
        key = g.check("idempotency_key", idempotency_key, key_header)
        request_sha = fingerprint(
            "train",
            body.booking_id,
            body.manifest_digest.lower(),
            confirmations.ref_hash(body.confirmation_ref),
        )
        # A retry after a lost response must find its run even though the one-time
        # gates (confirmation) were spent on the first attempt.
        existing = store.run_by_key(p.account_id, key)
        if existing is not None:
            g.run_id = existing["run_id"]
            return g.check("idempotency", _replay, c, existing, request_sha)
        try:
            with plan_slot(g, c):
                row = _gated_create(c, g, p, body, key, request_sha)
        except ItoError as e:
            if e.code != ErrorCode.confirmation_consumed:
                raise
            # A concurrent request with the same key may have consumed it for this run.
            existing = store.run_by_key(p.account_id, key)
            if existing is None:
                raise
            return g.check("idempotency", _replay, c, existing, request_sha)
        g.run_id = row["run_id"]
        if row.get("_replayed"):
            return g.check("idempotency", _replay, c, row, request_sha)
        g.record("run_created", True)
    try:
        c.runtime.submit(row["run_id"])
    except Exception:  # the run is committed; the runtime reconciles accepted runs
        log.exception("runtime.submit failed for %s", row["run_id"])
    return ok(
        {**run_view(store, row["run_id"], p), "replayed": False},
        notice=f"run {row['run_id']} accepted",
    )


def _gated_create(
    c: Ctx, g: Gates, p: Principal, body: RunRequest, key: str, request_sha: str
) -> Row:
    store = c.store
    eligibility = booking_gate(g, c, p, body.booking_id)
    parsed = manifest_gate(g, c, body.manifest_b64, body.manifest_digest)
    expect = confirmations.Expect(
        account_id=p.account_id,
        action="train",
        booking_id=body.booking_id,
        manifest_digest=parsed.digest,
        used_by_key=p.key_id,
    )
    conf = g.check("confirmation", confirmations.resolve, store, body.confirmation_ref, expect)
    g.record("idempotency", True)
    _report, cost, planned = validation_gate(g, c, parsed, eligibility)
    expect = replace(expect, cost_usd=cost.total_usd)
    g.check("confirmation_cost", confirmations.check, conf, expect)
    now = time.time()
    run: Row = {
        "run_id": new_id("run"),
        "account_id": p.account_id,
        "booking_id": body.booking_id,
        "manifest_id": parsed.manifest_id,
        "manifest_digest": parsed.digest,
        "manifest_json": parsed.raw.decode("utf-8"),
        "idempotency_key": key,
        "request_sha256": request_sha,
        "state": str(RunState.accepted),
        "state_reason": "all gates passed",
        "cost_estimate_usd": cost.total_usd,
        "plan": json.dumps(planned.plan) if c.settings.planner_gate and planned.plan else None,
        "data_prep": None,
        "created_at": now,
        "updated_at": now,
    }

    def create(conn: Conn) -> Row:
        # The confirmation's row lock first (SELECT ... FOR UPDATE): concurrent submits
        # of it queue there. Then the key (a same-key twin wins as a replay), then the
        # confirmation, consumed in the same transaction that inserts the run. Two keys'
        # runs racing on the (account, key) unique constraint: the loser runs again
        # (Store.write) and finds the twin.
        store.confirmation(confirmations.ref_hash(body.confirmation_ref or ""), conn)
        twin = store.run_by_key(p.account_id, key, conn)
        if twin is not None:
            return {**twin, "_replayed": True}
        # Counted under the same write lock, so concurrent submits cannot overshoot.
        cap = c.settings.max_active_runs_per_account
        if store.count_active_runs(conn, p.account_id) >= cap:
            raise ItoError(
                ErrorCode.too_many_active_runs,
                f"the account has {cap} active runs, the most allowed; wait for one to end",
            )
        confirmations.consume(store, conn, body.confirmation_ref, expect, by=run["run_id"])
        store.insert_run(conn, run)
        store.insert_log(
            conn,
            run["run_id"],
            None,
            now,
            "info",
            "orchestrator",
            f"accepted: {parsed.manifest_id}, estimated ${cost.total_usd:,.2f} ({cost.method})",
        )
        return run

    result: Row = g.check("commit", store.write, create)
    return result


@router.get("/v1/runs", response_model=Envelope)
def find_runs(
    idempotency_key: str = Query(max_length=128),
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    with Gates(c.store, "read", audit_passes=False) as g:
        p = g.auth(creds, "runs:read")
    run = c.store.run_by_key(p.account_id, idempotency_key)
    return ok({"runs": [run_view(c.store, run["run_id"], p)] if run else []})


def _read_run(c: Ctx, creds: HTTPAuthorizationCredentials | None, run_id: str) -> Row:
    return _read_own_run(c, creds, run_id)[0]


def _read_own_run(
    c: Ctx, creds: HTTPAuthorizationCredentials | None, run_id: str
) -> tuple[Row, Principal]:
    with Gates(c.store, "read", run_id=run_id, audit_passes=False) as g:
        p = g.auth(creds, "runs:read")
    return c.store.get_run(run_id, p.account_id), p


@router.get("/v1/runs/{run_id}", response_model=Envelope)
def get_run(
    run_id: str, creds: HTTPAuthorizationCredentials | None = Depends(bearer), c: Ctx = Depends(ctx)
) -> JSONResponse:
    with Gates(c.store, "read", run_id=run_id, audit_passes=False) as g:
        p = g.auth(creds, "runs:read")
    view = run_view(c.store, run_id, p)
    return ok(view, notice=f"run {run_id} is {view['state']}")


@router.get("/v1/runs/{run_id}/logs", response_model=Envelope)
def get_logs(
    run_id: str,
    cursor: str | None = Query(default=None, max_length=32),
    limit: int = Query(default=200, ge=1, le=1000),
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    _read_run(c, creds, run_id)
    after = 0
    if cursor:
        if not cursor.isdigit() or len(cursor) > 18:  # an SQLite INTEGER
            raise ItoError(ErrorCode.bad_request, "invalid cursor")
        after = int(cursor)
    rows = c.store.list_logs(run_id, after, min(limit, c.settings.logs_page_max))
    entries = [
        {
            "seq": r["seq"],
            "ts": r["ts"],
            "level": r["level"],
            "stage": r["stage"],
            "message": r["message"],
        }
        for r in rows
    ]
    next_cursor = str(rows[-1]["run_seq"]) if rows else str(after)
    return ok({"entries": entries, "next_cursor": next_cursor})


@router.get("/v1/runs/{run_id}/metrics", response_model=Envelope)
def get_metrics(
    run_id: str, creds: HTTPAuthorizationCredentials | None = Depends(bearer), c: Ctx = Depends(ctx)
) -> JSONResponse:
    _read_run(c, creds, run_id)
    provider = getattr(c.runtime, "metrics", None)
    data: dict[str, Any] = provider(run_id) if callable(provider) else run_metrics(c.store, run_id)
    return ok(data)


def retained_checkpoints(store: Store, run_id: str) -> list[Row]:
    """The checkpoints the trainer still keeps: its keep-K policy over the completed
    saves it reported, plus every checkpoint that closed a curriculum phase (kept
    whatever keep-K says), less any removed since (an approved restart discards newer
    ones; cleanup removes all). Each row carries its ``phase`` and ``closes_phase``.
    Existence is checked where the storage is visible here."""
    if store.get_run(run_id)["state"] == RunState.cleaned:
        return []
    keep = int(store.run_manifest(run_id)["checkpoint"]["keep"])
    phase_of: dict[int, str] = {}
    closing: set[int] = set()
    for ev in store.list_events(run_id, kinds=["checkpoint"], limit=1_000_000):
        body = ev["payload"]
        if body.get("phase"):
            phase_of[int(body["step"])] = str(body["phase"])
        if body.get("closes_phase"):
            closing.add(int(body["step"]))
    rows = store.list_checkpoints(run_id)
    kept = {r["step"] for r in rows if r["step"] not in closing}
    kept = set(sorted(kept)[-keep:]) | closing
    rows = [
        {**r, "phase": phase_of.get(r["step"], ""), "closes_phase": r["step"] in closing}
        for r in rows
        if r["step"] in kept
    ]
    return [r for r in rows if Path(r["path"]).exists() or not Path(r["path"]).parent.exists()]


@router.get("/v1/runs/{run_id}/checkpoints", response_model=Envelope)
def get_checkpoints(
    run_id: str, creds: HTTPAuthorizationCredentials | None = Depends(bearer), c: Ctx = Depends(ctx)
) -> JSONResponse:
    _read_run(c, creds, run_id)
    rows = retained_checkpoints(c.store, run_id)
    return ok(
        {
            "checkpoints": [
                {
                    "step": r["step"],
                    "path": r["path"],
                    "bytes": r["bytes"],
                    "blocking_s": r["blocking_s"],
                    "total_s": r["total_s"],
                    "bytes_per_s": r["bytes"] / r["total_s"] if r["total_s"] > 0 else None,
                    "created_at": iso(r["created_at"]),
                    "phase": r["phase"],
                    "closes_phase": r["closes_phase"],
                }
                for r in rows
            ]
        }
    )
