"""The gates shared by plan, confirm and submit: booking, manifest, validation."""

from __future__ import annotations

import time
from typing import Any

from orchestrator.api.deps import Ctx, Gates
from orchestrator.gates.auth import Principal
from orchestrator.gates.bookings import check_eligibility
from orchestrator.gates.costing import CostEstimate
from orchestrator.gates.manifest import ParsedManifest, decode_b64, parse_manifest
from orchestrator.gates.planning import PlanResult, plan_manifest
from orchestrator.gates.roots import account_roots
from orchestrator.gates.validation import validate


def booking_gate(g: Gates, c: Ctx, p: Principal, booking_id: str) -> dict[str, Any]:
    g.booking_id = booking_id
    return g.check(
        "booking",
        check_eligibility,
        c.store,
        booking_id,
        p.account_id,
        c.settings.eligibility_ttl_s,
    )


def manifest_gate(
    g: Gates, c: Ctx, manifest_b64: str, manifest_digest: str | None
) -> ParsedManifest:
    def _gate() -> ParsedManifest:
        raw = decode_b64(manifest_b64, c.settings.max_manifest_bytes)
        return parse_manifest(raw, manifest_digest)

    return g.check("manifest", _gate)


def validation_gate(
    g: Gates,
    c: Ctx,
    parsed: ParsedManifest,
    eligibility: dict[str, Any],
) -> tuple[dict[str, Any], CostEstimate, PlanResult]:
    remaining_h = (eligibility["_term_end_ts"] - time.time()) / 3600.0
    planned: list[PlanResult] = []

    def gate_plan() -> float | None:
        # Called by validate() once every other check passed (so the planner only sees
        # a known preset, SKU and fabric).
        planned.append(plan_manifest(parsed.model, eligibility, c.settings.plan_time_budget_s))
        if not c.settings.planner_gate:
            return None
        planned[0].raise_refusal()
        return planned[0].step_time_s

    assert g.principal is not None
    roots = account_roots(c.settings, c.store, g.principal.account_id)
    report, cost = g.check(
        "validation", validate, c.settings, parsed.model, eligibility, remaining_h, gate_plan, roots
    )
    return report, cost, planned[0]


def public(eligibility: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in eligibility.items() if not k.startswith("_")}
