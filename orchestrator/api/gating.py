"""The gates shared by plan, confirm and submit: booking, manifest, validation."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request

from orchestrator.api.deps import Ctx, Gates, ctx
from orchestrator.api.ratelimit import key_id_of
from orchestrator.gates.auth import Principal
from orchestrator.gates.bookings import check_eligibility
from orchestrator.gates.costing import CostEstimate
from orchestrator.gates.manifest import ParsedManifest, decode_b64, parse_manifest
from orchestrator.gates.planning import PlanResult, plan_manifest
from orchestrator.gates.roots import account_roots
from orchestrator.gates.validation import validate
from stages.errors import ErrorCode, ItoError

# Key ids whose account the plan bound remembers (least recently seen dropped).
MAX_KNOWN_KEYS = 10_000


class PlanSlots:
    """Plan validations in flight per account on this replica (manifest parsing, the
    secret scan, validation and the planner: up to a 1 MiB manifest each)."""

    def __init__(self, per_account: int, retry_after_s: int):
        self.per_account, self.retry_after_s = per_account, retry_after_s
        self._held: dict[str, int] = {}
        # Key id -> account, learnt from authenticated plan work (key ids are not
        # secret): the event loop refuses a known key's account at its bound before the
        # request takes a handler thread (``refuse_early``).
        self._accounts: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def refusal(self) -> ItoError:
        return ItoError(
            ErrorCode.too_many_concurrent_plans,
            f"the account has {self.per_account} plan validations in flight, the most "
            "allowed; retry after the Retry-After seconds",
            details={"retry_after_s": self.retry_after_s},
        )

    def acquire(self, account_id: str, key_id: str | None = None) -> None:
        with self._lock:
            if key_id is not None:
                self._accounts[key_id] = account_id
                self._accounts.move_to_end(key_id)
                while len(self._accounts) > MAX_KNOWN_KEYS:
                    self._accounts.popitem(last=False)
            held = self._held.get(account_id, 0)
            if held >= self.per_account:
                raise self.refusal()
            self._held[account_id] = held + 1

    def full(self, key_id: str) -> bool:
        """Whether the account this key was last seen with is at its bound."""
        with self._lock:
            account_id = self._accounts.get(key_id)
            return account_id is not None and self._held.get(account_id, 0) >= self.per_account

    def release(self, account_id: str) -> None:
        with self._lock:
            left = self._held[account_id] - 1
            if left:
                self._held[account_id] = left
            else:
                del self._held[account_id]


@contextmanager
def plan_slot(g: Gates, c: Ctx) -> Iterator[None]:
    """One of the account's plan slots for the manifest work inside (audited when
    refused)."""
    assert g.principal is not None
    account_id = g.principal.account_id
    g.check("plan_slots", c.plan_slots.acquire, account_id, g.principal.key_id)
    try:
        yield
    finally:
        c.plan_slots.release(account_id)


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


async def refuse_early(request: Request) -> None:
    """A dependency of the plan routes, run in the event loop before the handler takes a
    thread: a key whose account is at its plan bound is refused at once, so a burst of
    one account's plans costs no handler thread beyond its bound. (The handler's
    ``plan_slot`` is the bound itself; this only refuses sooner.)"""
    c = ctx(request)
    key_id = key_id_of(request.headers.get("authorization"))
    if key_id is not None and c.plan_slots.full(key_id):
        c.store.audit_counted("plan", str(ErrorCode.too_many_concurrent_plans), gate="plan_slots")
        raise c.plan_slots.refusal()
