"""POST /v1/plans: validation, cost and digest. Creates no run, reserves no key,
consumes no confirmation."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from orchestrator.api.deps import Ctx, Gates, bearer, ctx
from orchestrator.api.envelope import Envelope, ok
from orchestrator.api.gating import (
    booking_gate,
    manifest_gate,
    public,
    validation_gate,
)
from orchestrator.api.models import PlanRequest
from orchestrator.api.planbound import plan_slot

router = APIRouter(tags=["plans"])


@router.post("/v1/plans", response_model=Envelope)
def plan(
    body: PlanRequest,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    c: Ctx = Depends(ctx),
) -> JSONResponse:
    with Gates(c.store, "plan", booking_id=body.booking_id) as g:
        # The approver reviews the plan and its cost before confirming: a confirm:train
        # key may plan too (it still cannot submit or read runs).
        p = g.auth(creds, "runs:read", "confirm:train")
        eligibility = booking_gate(g, c, p, body.booking_id)
        with plan_slot(g, c):
            parsed = manifest_gate(g, c, body.manifest_b64, body.manifest_digest)
            report, cost, planned = validation_gate(g, c, parsed, eligibility)
    return ok(
        {
            "booking_id": body.booking_id,
            "manifest_id": parsed.manifest_id,
            "manifest_digest": parsed.digest,
            "eligibility": public(eligibility),
            "validation": report,
            "cost_estimate_usd": cost.total_usd,
            "incremental_cost_usd": cost.incremental_usd,
            "plan": planned.plan,
            "plan_refusal": planned.refusal,
            "planner_gate": c.settings.planner_gate,
        },
        notice="plan only: no run was created, no key reserved, no confirmation consumed",
    )
