"""GET /v1/bookings/{id}/eligibility: fresh, bound, fail-closed.

The answer also names the caller's own data and checkpoint roots, so a client can place
what it writes (``ito manifest init``'s checkpoint folder) where the server accepts it."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from orchestrator.api.deps import Ctx, Gates, bearer, ctx
from orchestrator.api.envelope import Envelope, ok
from orchestrator.api.gating import booking_gate, public
from orchestrator.gates.roots import account_roots
from orchestrator.redact import safe_id

router = APIRouter(tags=["bookings"])


@router.get("/v1/bookings/{booking_id}/eligibility", response_model=Envelope)
def eligibility(
    booking_id: str,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    with Gates(c.store, "eligibility", booking_id=booking_id) as g:
        p = g.auth(creds, "runs:read")
        result = booking_gate(g, c, p, booking_id)
        roots = account_roots(c.settings, c.store, p.account_id)
    data = {
        **public(result),
        "roots": {"data": list(roots.data), "checkpoint": list(roots.checkpoint)},
    }
    return ok(
        data, notice=f"booking {safe_id(booking_id)} is eligible until {result['valid_until']}"
    )
