"""GET /v1/bookings/{id}/eligibility: fresh, bound, fail-closed."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from orchestrator.api.deps import Ctx, Gates, bearer, ctx
from orchestrator.api.envelope import Envelope, ok
from orchestrator.api.gating import booking_gate, public
from orchestrator.redact import safe_id

router = APIRouter(tags=["bookings"])


@router.get("/v1/bookings/{booking_id}/eligibility", response_model=Envelope)
def eligibility(booking_id: str, creds: HTTPAuthorizationCredentials | None = Depends(bearer),
                c: Ctx = Depends(ctx)) -> JSONResponse:
    with Gates(c.store, "eligibility", booking_id=booking_id) as g:
        p = g.auth(creds, "runs:read")
        result = booking_gate(g, c, p, booking_id)
    return ok(public(result), notice=f"booking {safe_id(booking_id)} is eligible until "
                                     f"{result['valid_until']}")
