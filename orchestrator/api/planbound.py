"""The per-account bound on plan validations (manifest parsing, the secret scan,
validation and the planner: up to a 1 MiB manifest each, seconds of one core).

``plan_slot`` is the bound: the handler holds one of the account's slots for the
manifest work of ``POST /v1/plans``, a train confirmation and ``POST /v1/runs``;
beyond ``plans_in_flight_per_account`` it answers 429 too_many_concurrent_plans with
Retry-After. ``PlanBoundGate`` only refuses sooner: a request of a key whose account
is at its bound is answered before its body is read or a handler thread is taken, so
a burst costs the server almost nothing beyond the bound's own work.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.api.deps import Ctx, Gates
from orchestrator.api.envelope import fail_body
from orchestrator.api.ratelimit import key_id_of
from orchestrator.db.store import Store
from stages.errors import ErrorCode, ItoError

# The routes whose whole body is plan work (a train confirmation's body may be a
# cancel's: only its handler knows).
PLAN_ROUTES = (("POST", "/v1/plans"), ("POST", "/v1/runs"))


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
        # request's body is read (``PlanBoundGate``).
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


class PlanBoundGate:
    """Pure ASGI, outside the body cap: a plan request of a key whose account is at its
    bound is refused before its body is read (the key's account as last seen by
    ``PlanSlots``; key ids are not secret, and a refusal costs only the asker)."""

    def __init__(self, app: ASGIApp, slots: PlanSlots, store: Store):
        self.app, self.slots, self.store = app, slots, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope.get("method"), scope.get("path")) in PLAN_ROUTES:
            authorization = None
            for name, value in scope.get("headers") or ():
                if name.lower() == b"authorization":
                    authorization = value.decode("latin-1")
            key_id = key_id_of(authorization)
            if key_id is not None and self.slots.full(key_id):
                self.store.audit_counted(
                    "plan", str(ErrorCode.too_many_concurrent_plans), gate="load"
                )
                await self._refuse(send)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send) -> None:
        err = self.slots.refusal()
        body = json.dumps(fail_body(err.code, err.message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 429,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(max(1, math.ceil(self.slots.retry_after_s))).encode()),
                    (b"connection", b"close"),  # its body was not read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
