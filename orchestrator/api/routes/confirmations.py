"""POST /v1/confirmations: the approver's one-time consent to one mutation."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from orchestrator.api.deps import Ctx, Gates, bearer, ctx
from orchestrator.api.envelope import Envelope, ok
from orchestrator.api.gating import booking_gate, manifest_gate
from orchestrator.api.models import ConfirmationRequest
from orchestrator.api.planbound import plan_slot
from orchestrator.db.store import Store
from orchestrator.gates import confirmations
from orchestrator.gates.auth import Principal
from orchestrator.gates.bookings import iso
from orchestrator.redact import safe_id
from stages.errors import ErrorCode, ItoError

router = APIRouter(tags=["confirmations"])


def _owned_booking(store: Store, p: Principal, booking_id: str) -> None:
    row = store.booking(booking_id)
    # Another account's booking answers exactly as a missing one: ids do not leak.
    if row is None or row["account_id"] != p.account_id:
        raise ItoError(ErrorCode.booking_not_found, f"no booking {safe_id(booking_id)}")


def _bound_run(store: Store, p: Principal, body: ConfirmationRequest) -> None:
    if not body.run_id:
        raise ItoError(ErrorCode.bad_request, f"a {body.action} confirmation needs run_id")
    run = store.get_run(body.run_id, p.account_id)
    if run["booking_id"] != body.booking_id:
        raise ItoError(
            ErrorCode.confirmation_booking_mismatch, "the run belongs to another booking"
        )
    if body.action == "restart":
        if not body.proposal_id:
            raise ItoError(ErrorCode.bad_request, "a restart confirmation needs proposal_id")
        if not any(x["proposal_id"] == body.proposal_id for x in store.list_proposals(body.run_id)):
            raise ItoError(ErrorCode.proposal_not_found, f"no proposal {safe_id(body.proposal_id)}")


@router.post("/v1/confirmations", response_model=Envelope)
def create_confirmation(
    body: ConfirmationRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    s = c.settings
    with Gates(
        c.store, f"confirm:{body.action}", booking_id=body.booking_id, run_id=body.run_id
    ) as g:
        p = g.auth(creds, f"confirm:{body.action}")
        ttl = s.confirmation_ttl_default_s if body.ttl_s is None else body.ttl_s
        if not 0 < ttl <= s.confirmation_ttl_max_s:
            g.record("ttl", False, ErrorCode.confirmation_ttl_invalid)
            raise ItoError(
                ErrorCode.confirmation_ttl_invalid,
                f"ttl_s must be in 1..{s.confirmation_ttl_max_s}",
            )
        digest = None
        if body.action == "train":
            if not body.manifest_b64:
                raise ItoError(ErrorCode.bad_request, "a train confirmation needs manifest_b64")
            booking_gate(g, c, p, body.booking_id)
            with plan_slot(g, c):
                digest = manifest_gate(g, c, body.manifest_b64, body.manifest_digest).digest
        elif body.action == "release":
            g.check("booking", _owned_booking, c.store, p, body.booking_id)
        else:
            g.check("booking", _owned_booking, c.store, p, body.booking_id)
            g.check("run", _bound_run, c.store, p, body)
        ref, row = confirmations.create(
            c.store,
            p,
            action=body.action,
            booking_id=body.booking_id,
            cost_usd=body.cost_usd,
            ttl_s=ttl,
            manifest_digest=digest,
            run_id=body.run_id,
            proposal_id=body.proposal_id if body.action == "restart" else None,
        )
        g.record("confirmation_issued", True)
    return ok(
        {
            "confirmation_ref": ref,
            "action": body.action,
            "booking_id": body.booking_id,
            "manifest_digest": digest,
            "run_id": body.run_id,
            "proposal_id": row["proposal_id"],
            "cost_usd": row["cost_usd"],
            "expires_at": iso(row["expires_at"]),
        },
        notice=f"one-time {body.action} confirmation; hand the reference to the submitter",
    )
