"""Cancel, cleanup, proposal decisions and booking release: each a mutation with its
own confirmation action and its own Idempotency-Key.

Shape of each: auth -> idempotency replay -> target -> confirmation (read-only)
-> one transaction (re-check key, consume confirmation, change state, record key)
-> tell the runtime after the commit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header
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
from orchestrator.api.models import MutationRequest
from orchestrator.db.store import Conn, Row
from orchestrator.gates import confirmations
from orchestrator.gates.auth import Principal
from orchestrator.gates.bookings import owned_live_booking
from orchestrator.redact import safe_id
from orchestrator.runs import ACTIVE, RunState
from stages.errors import ErrorCode, ItoError

log = logging.getLogger("ito.api")
router = APIRouter(tags=["mutations"])


def _mutate(
    c: Ctx,
    g: Gates,
    p: Principal,
    key: str,
    action: str,
    target: str,
    ref: str,
    expect: confirmations.Expect,
    apply: Callable[[Conn], None],
) -> tuple[bool, Row | None]:
    """Returns (replayed, idempotency record). Raises the first failing gate."""
    store = c.store
    request_sha = fingerprint(action, target, confirmations.ref_hash(ref))

    def replay(rec: Row) -> tuple[bool, Row]:
        if rec["request_sha256"] != request_sha:
            raise ItoError(
                ErrorCode.idempotency_conflict,
                "this Idempotency-Key was used for a different request",
            )
        return True, rec

    rec = store.get_idempotency(p.account_id, key)
    if rec is not None:
        return g.check("idempotency", replay, rec)
    g.check("confirmation", confirmations.resolve, store, ref, expect)

    def tx(conn: Conn) -> tuple[bool, Row | None]:
        # The confirmation's row lock first: concurrent uses queue on it, and the next
        # in line sees the winner's idempotency record (or the used confirmation).
        store.confirmation(confirmations.ref_hash(ref), conn)
        twin = store.idempotency_record(conn, p.account_id, key)
        if twin is not None:
            return replay(twin)
        confirmations.consume(store, conn, ref, expect, by=f"{action}:{target}")
        apply(conn)
        store.insert_idempotency(conn, p.account_id, key, request_sha, action, target)
        return False, None

    try:
        result: tuple[bool, Row | None] = g.check("commit", store.write, tx)
    except ItoError as e:
        twin = store.get_idempotency(p.account_id, key)
        if e.code == ErrorCode.confirmation_consumed and twin is not None:
            return g.check("idempotency", replay, twin)
        raise
    return result


def _run_mutation(
    action: Literal["cancel", "cleanup"],
    run_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None,
    key_header: str | None,
    c: Ctx,
) -> tuple[bool, Row | None, Row]:
    with Gates(c.store, action, run_id=run_id) as g:
        p = g.auth(creds, "runs:write")
        key = g.check("idempotency_key", idempotency_key, key_header)
        run = g.check("run", c.store.get_run, run_id, p.account_id)
        g.booking_id = run["booking_id"]
        expect = confirmations.Expect(
            account_id=p.account_id,
            action=action,
            booking_id=run["booking_id"],
            run_id=run_id,
            used_by_key=p.key_id,
        )
        to = RunState.cancelling if action == "cancel" else RunState.cleaned
        why = "cancel requested" if action == "cancel" else "cleanup requested"

        def apply(conn: Conn) -> None:
            c.store.transition(run_id, to, why, conn=conn)

        replayed, rec = _mutate(c, g, p, key, action, run_id, body.confirmation_ref, expect, apply)
    return replayed, rec, run


@router.post("/v1/runs/{run_id}/cancel", response_model=Envelope)
def cancel_run(
    run_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    key_header: str | None = Header(default=None, alias="Idempotency-Key"),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    replayed, _, _ = _run_mutation("cancel", run_id, body, creds, key_header, c)
    if not replayed:
        try:
            c.runtime.cancel(run_id)
        except Exception:  # committed as cancelling; the runtime reconciles it
            log.exception("runtime.cancel failed for %s", run_id)
    view = run_view(c.store, run_id)
    return ok({**view, "replayed": replayed}, notice=f"run {run_id} is {view['state']}")


@router.post("/v1/runs/{run_id}/cleanup", response_model=Envelope)
def cleanup_run(
    run_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    key_header: str | None = Header(default=None, alias="Idempotency-Key"),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    replayed, rec, run = _run_mutation("cleanup", run_id, body, creds, key_header, c)
    if rec is not None and rec["response"]:
        result = json.loads(rec["response"])
    else:
        # First time, or a replay after a crash between commit and removal: removing
        # again is harmless (it removes nothing that is already gone).
        result = c.runtime.cleanup(run_id)
        c.store.set_idempotency_response(run["account_id"], key_header or "", result)
    return ok(
        {
            "run": run_view(c.store, run_id),
            "removed": result.get("removed", []),
            "bytes_removed": result.get("bytes_removed", 0),
            "booking_untouched": True,
            "replayed": replayed,
        },
        notice=f"run {run_id} cleaned; the booking was not changed",
    )


def _decide(
    decision: Literal["approved", "declined"],
    run_id: str,
    proposal_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None,
    key_header: str | None,
    c: Ctx,
) -> JSONResponse:
    with Gates(c.store, f"proposal:{decision}", run_id=run_id) as g:
        p = g.auth(creds, "runs:write")
        key = g.check("idempotency_key", idempotency_key, key_header)
        run = g.check("run", c.store.get_run, run_id, p.account_id)
        g.booking_id = run["booking_id"]
        if not any(x["proposal_id"] == proposal_id for x in c.store.list_proposals(run_id)):
            g.record("proposal", False, ErrorCode.proposal_not_found)
            raise ItoError(ErrorCode.proposal_not_found, f"no proposal {safe_id(proposal_id)}")
        expect = confirmations.Expect(
            account_id=p.account_id,
            action="restart",
            booking_id=run["booking_id"],
            run_id=run_id,
            proposal_id=proposal_id,
            used_by_key=p.key_id,
        )

        def apply(conn: Conn) -> None:
            state = conn.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()[
                "state"
            ]
            if state not in (RunState.running, RunState.awaiting_approval):
                raise ItoError(ErrorCode.invalid_state, f"run is {state}; nothing to decide")
            c.store.decide_proposal(conn, run_id, proposal_id, decision)

        replayed, _ = _mutate(
            c,
            g,
            p,
            key,
            f"proposal:{decision}",
            f"{run_id}/{proposal_id}",
            body.confirmation_ref,
            expect,
            apply,
        )
    if not replayed:
        try:
            c.runtime.decide(run_id, proposal_id, decision)
        except Exception:
            log.exception("runtime.decide failed for %s/%s", run_id, proposal_id)
    return ok(
        {**run_view(c.store, run_id), "replayed": replayed},
        notice=f"proposal {proposal_id} {decision}",
    )


@router.post("/v1/runs/{run_id}/proposals/{proposal_id}/approve", response_model=Envelope)
def approve(
    run_id: str,
    proposal_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    key_header: str | None = Header(default=None, alias="Idempotency-Key"),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    return _decide("approved", run_id, proposal_id, body, creds, key_header, c)


@router.post("/v1/runs/{run_id}/proposals/{proposal_id}/decline", response_model=Envelope)
def decline(
    run_id: str,
    proposal_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    key_header: str | None = Header(default=None, alias="Idempotency-Key"),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    return _decide("declined", run_id, proposal_id, body, creds, key_header, c)


def _release_check(c: Ctx, p: Principal, booking_id: str) -> None:
    owned_live_booking(c.store, booking_id, p.account_id)


@router.post("/v1/bookings/{booking_id}/release", response_model=Envelope)
def release_booking(
    booking_id: str,
    body: MutationRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    key_header: str | None = Header(default=None, alias="Idempotency-Key"),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    """The separate economic action: only a ``release`` confirmation releases a booking."""
    with Gates(c.store, "release", booking_id=booking_id) as g:
        p = g.auth(creds, "runs:write")
        key = g.check("idempotency_key", idempotency_key, key_header)
        rec = c.store.get_idempotency(p.account_id, key)
        if rec is None:
            g.check("booking", _release_check, c, p, booking_id)
        expect = confirmations.Expect(
            account_id=p.account_id, action="release", booking_id=booking_id, used_by_key=p.key_id
        )

        def apply(conn: Conn) -> None:
            active = conn.execute(
                f"SELECT COUNT(*) AS n FROM runs WHERE booking_id = ? AND state IN "
                f"({','.join('?' * len(ACTIVE))})",
                (booking_id, *map(str, ACTIVE)),
            ).fetchone()
            if active["n"]:
                raise ItoError(
                    ErrorCode.invalid_state,
                    f"{active['n']} run(s) still active on this booking; cancel first",
                )
            c.store.set_booking_state(booking_id, "released", conn=conn)

        replayed, _ = _mutate(
            c, g, p, key, "release", booking_id, body.confirmation_ref, expect, apply
        )
    data: dict[str, Any] = {"booking_id": booking_id, "state": "released", "replayed": replayed}
    return ok(data, notice=f"booking {booking_id} released")
