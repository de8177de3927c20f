"""Rate limits and the batched audit of unauthenticated failures (pure ASGI).

Two token buckets, refilled continuously:

* per API key (by its public key id): every request with a key that authenticates
  spends a token; an empty bucket answers ``429 rate_limited`` with ``Retry-After``
  before the handler runs.
* per client address, for authentication failures: each ``401`` spends a token from
  the address's bucket. Once it is empty, further requests from that address whose
  key does not authenticate (one indexed read, no write) get ``429`` at once, while
  requests with a valid key from the same address are still served.

A flood of bad keys therefore costs one cheap read each and no write: the failures
it causes are audited as one counted row per (action, code) per window
(``Store.audit_counted``), never one write transaction per request.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.api.envelope import fail_body
from orchestrator.db.store import Store
from orchestrator.gates.auth import authenticate
from stages.errors import ErrorCode, ItoError

# Buckets kept at most (least recently used dropped): a flood of made-up key ids or
# addresses cannot grow memory without bound.
MAX_BUCKETS = 10_000


class Buckets:
    def __init__(self, rate_per_s: float, burst: int):
        self.rate, self.burst = rate_per_s, float(burst)
        self._b: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def _level(self, name: str, now: float) -> float:
        tokens, ts = self._b.get(name, (self.burst, now))
        return min(self.burst, tokens + (now - ts) * self.rate)

    def empty(self, name: str, now: float | None = None) -> float:
        """Seconds until a token is available (0 if one is available now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            level = self._level(name, now)
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def spend(self, name: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            level = self._level(name, now)
            self._b[name] = (max(0.0, level - 1.0), now)
            self._b.move_to_end(name)
            while len(self._b) > MAX_BUCKETS:
                self._b.popitem(last=False)


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return str(v.decode("latin-1"))
    return None


def key_id_of(authorization: str | None) -> str | None:
    """The public id in ``Bearer itok_<key_id>_<secret>`` (not secret), if shaped so."""
    if not authorization or not authorization.startswith("Bearer itok_"):
        return None
    parts = authorization.removeprefix("Bearer ").strip().split("_", 2)
    return parts[1][:32] if len(parts) == 3 else None


class RateLimit:
    def __init__(
        self,
        app: ASGIApp,
        store: Store,
        *,
        key_per_s: float,
        key_burst: int,
        fail_per_s: float,
        fail_burst: int,
    ):
        self.app, self.store = app, store
        self.keys = Buckets(key_per_s, key_burst)
        self.fails = Buckets(fail_per_s, fail_burst)

    async def _refuse(self, send: Send, retry_after_s: float) -> None:
        body = json.dumps(
            fail_body(
                ErrorCode.rate_limited, "too many requests; retry after the Retry-After seconds"
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 429,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authenticates(self, authorization: str | None) -> bool:
        try:
            authenticate(self.store, authorization)
        except ItoError as e:
            if e.code == ErrorCode.store_unavailable:
                raise  # a 503 (the app's handler), not a refusal of the key
            return False
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = str(client[0]) if client else "unknown"
        authorization = _header(scope, b"authorization")
        key_id = key_id_of(authorization)
        if key_id is not None and (wait := self.keys.empty(f"k:{key_id}")) > 0:
            self.store.audit_counted("rate_limit", "rate_limited")
            await self._refuse(send, wait)
            return
        wait = self.fails.empty(f"a:{address}")
        if wait > 0 and not self._authenticates(authorization):
            self.store.audit_counted("rate_limit", "rate_limited")
            await self._refuse(send, wait)
            return
        status: list[int] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        await self.app(scope, receive, capture)
        if status and status[0] == 401:
            self.fails.spend(f"a:{address}")
        elif key_id is not None:
            self.keys.spend(f"k:{key_id}")
