"""The canonical client of the ito-train HTTP API (docs/api-contract.md).

Every method returns one envelope (a dict): the server's, or one the client made
with ``live_api_contacted: false`` when the server was never reached. Nothing
raises for a remote or transport failure.

Transport rules the contract asks for:

* every call has a bounded connect timeout and a bounded *total* timeout (the
  whole request, not each socket read), see ``ClientSettings``;
* a request is classified after a failure: ``not_sent`` (connect refused, DNS,
  connect timeout: safe to retry) or ``ambiguous`` (the request may have reached
  the server: read timeout, connection reset after the request was written, a
  non-envelope 5xx from a proxy, a 5xx envelope);
* ``train`` never creates a second run because a response was lost: after an
  ambiguous failure it looks the run up by idempotency key (``GET
  /v1/runs?idempotency_key=K``) before any retry; retries are bounded with
  exponential backoff and reuse the same key;
* polling (``follow_status``/``follow_logs``) stops at once on
  ``credential_revoked``/``unauthenticated``/``forbidden_scope``; it never tries
  to obtain a new credential.

An ``ItoClient`` drives an asyncio loop of its own (httpx's async client is what
makes the total timeout exact: the request task is cancelled at the deadline); use
one client per thread, not from inside a running event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.client.credentials import ApiKey
from orchestrator.client.manifest_reader import ManifestBytes
from stages.errors import ErrorCode

Envelope = dict[str, Any]

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "cleaned"})
# Answers after which polling must stop and hand control back (never re-login).
STOP_POLLING_CODES = frozenset(
    {
        ErrorCode.credential_revoked,
        ErrorCode.unauthenticated,
        ErrorCode.forbidden_scope,
        ErrorCode.account_disabled,
    }
)
INSECURE_HTTP_ENV = "ITO_ALLOW_INSECURE_HTTP"


class ClientSettings(BaseModel):
    """Every timeout and retry bound of the client, in one place."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    total_timeout_s: float = Field(default=30.0, gt=0)
    max_response_bytes: int = Field(default=16 << 20, gt=0)
    # Attempts of POST /v1/runs (and of other keyed mutations), including the first.
    train_max_attempts: int = Field(default=4, ge=1)
    # Attempts of an idempotent read (GET), including the first.
    read_max_attempts: int = Field(default=3, ge=1)
    retry_backoff_s: float = Field(default=0.5, ge=0)
    retry_backoff_max_s: float = Field(default=5.0, ge=0)
    poll_interval_s: float = Field(default=2.0, gt=0)
    # A follow gives up after this many transport failures in a row.
    follow_max_transport_failures: int = Field(default=5, ge=1)
    logs_page_limit: int = Field(default=200, ge=1)


def error_envelope(
    code: ErrorCode | str, message: str, *, live_api_contacted: bool = False, notice: str = ""
) -> Envelope:
    return {
        "ok": False,
        "live_api_contacted": live_api_contacted,
        "notice": notice,
        "error": {"code": str(code), "message": message},
    }


def ok_envelope(
    data: dict[str, Any], *, live_api_contacted: bool = True, notice: str = ""
) -> Envelope:
    return {"ok": True, "live_api_contacted": live_api_contacted, "notice": notice, "data": data}


def error_code(env: Envelope) -> str | None:
    err = env.get("error")
    return err.get("code") if isinstance(err, dict) else None


def is_envelope(body: object) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        return False
    if body["ok"]:
        return isinstance(body.get("data"), dict)
    return isinstance(body.get("error"), dict) and isinstance(body["error"].get("code"), str)


def check_api_url(api_url: str, environ: dict[str, str] | None = None) -> str:
    """Validate the server URL; returns it without a trailing slash or raises ValueError.

    Plain http is allowed only to loopback (the bearer key would travel in clear
    text) unless ``ITO_ALLOW_INSECURE_HTTP=1``; credentials in the URL are refused.
    """
    import os

    env = os.environ if environ is None else environ
    parts = urlsplit(api_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"API URL must be http(s)://host[:port], got {api_url!r}")
    if parts.username or parts.password:
        raise ValueError("API URL must not carry credentials (user:pass@); use ITO_API_KEY")
    if parts.query or parts.fragment:
        raise ValueError("API URL must not carry a query or fragment")
    if parts.scheme == "http" and env.get(INSECURE_HTTP_ENV) != "1":
        host = parts.hostname
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise ValueError(
                f"plain http to a non-loopback host would send the API key in clear text; "
                f"use https (or set {INSECURE_HTTP_ENV}=1 on a trusted network)"
            )
    return api_url.rstrip("/")


@dataclass
class _Result:
    """One HTTP exchange: the envelope plus what we know about delivery."""

    envelope: Envelope
    kind: Literal["answered", "not_sent", "ambiguous"]
    status: int | None = None


class ItoClient:
    """Typed calls over the v1 contract; every call returns an envelope."""

    def __init__(
        self,
        api_url: str,
        api_key: ApiKey | str | None,
        *,
        connect_timeout_s: float | None = None,
        total_timeout_s: float | None = None,
        settings: ClientSettings | None = None,
        sleep: Callable[[float], None] = time.sleep,
        user_agent: str = "ito-client/1",
    ):
        base = settings or ClientSettings()
        overrides: dict[str, float] = {}
        if connect_timeout_s is not None:
            overrides["connect_timeout_s"] = connect_timeout_s
        if total_timeout_s is not None:
            overrides["total_timeout_s"] = total_timeout_s
        self.settings = base.model_copy(update=overrides) if overrides else base
        self.api_url = api_url.rstrip("/")
        self._key = ApiKey(api_key, source="argument") if isinstance(api_key, str) else api_key
        self._sleep = sleep
        self._user_agent = user_agent
        self._loop = asyncio.new_event_loop()
        self._http: httpx.AsyncClient | None = None
        self.requests_sent = 0  # attempts that reached the wire or tried to

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        if self._http is not None:
            self._loop.run_until_complete(self._http.aclose())
            self._http = None
        self._loop.close()

    def __enter__(self) -> ItoClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- transport ----------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            s = self.settings
            self._http = httpx.AsyncClient(
                base_url=self.api_url,
                timeout=httpx.Timeout(s.total_timeout_s, connect=s.connect_timeout_s),
                follow_redirects=False,  # a redirect must never carry the key elsewhere
                trust_env=False,  # no proxy or netrc from the environment
                headers={"User-Agent": self._user_agent, "Accept": "application/json"},
            )
        return self._http

    async def _exchange(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        params: dict[str, Any] | None,
        headers: dict[str, str],
    ) -> _Result:
        sent = False

        async def trace(event: str, _info: dict[str, Any]) -> None:
            nonlocal sent
            if ".send_request" in event:
                sent = True

        s = self.settings
        try:
            async with asyncio.timeout(s.total_timeout_s):
                async with self._client().stream(
                    method,
                    path,
                    json=body,
                    params=params,
                    headers=headers,
                    extensions={"trace": trace},
                ) as resp:
                    buf = bytearray()
                    async for chunk in resp.aiter_bytes():
                        buf += chunk
                        if len(buf) > s.max_response_bytes:
                            return _Result(
                                error_envelope(
                                    ErrorCode.payload_too_large,
                                    f"response larger than {s.max_response_bytes} bytes",
                                ),
                                "ambiguous",
                                resp.status_code,
                            )
                    return self._interpret(method, path, resp.status_code, bytes(buf))
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            code = (
                ErrorCode.api_unreachable
                if isinstance(exc, httpx.ConnectError)
                else (ErrorCode.api_timeout)
            )
            return _Result(
                error_envelope(
                    code,
                    f"{method} {path}: cannot connect to {self.api_url} ({type(exc).__name__})",
                ),
                "not_sent",
            )
        except (TimeoutError, httpx.TimeoutException) as exc:
            kind: Literal["not_sent", "ambiguous"] = "ambiguous" if sent else "not_sent"
            return _Result(
                error_envelope(
                    ErrorCode.api_timeout,
                    f"{method} {path}: no complete answer within the total timeout "
                    f"({s.total_timeout_s:g}s; {type(exc).__name__})",
                ),
                kind,
            )
        except httpx.TransportError as exc:
            kind = "ambiguous" if sent else "not_sent"
            return _Result(
                error_envelope(
                    ErrorCode.api_unreachable,
                    f"{method} {path}: connection failed ({type(exc).__name__})",
                ),
                kind,
            )

    def _interpret(self, method: str, path: str, status: int, raw: bytes) -> _Result:
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if is_envelope(body):
            assert isinstance(body, dict)
            # A 5xx envelope may have been produced after the work was committed.
            return _Result(body, "ambiguous" if status >= 500 else "answered", status)
        # Not the ito API talking: a proxy, a load balancer, or a wrong URL.
        msg = f"{method} {path}: HTTP {status} without an ito envelope (proxy or wrong URL?)"
        return _Result(
            error_envelope(ErrorCode.api_unreachable, msg),
            "ambiguous" if status >= 500 else "answered",
            status,
        )

    def _headers(self, idempotency_key: str | None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key.reveal()}"
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        return headers

    def _once(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> _Result:
        self.requests_sent += 1
        return self._loop.run_until_complete(
            self._exchange(method, path, body, params, self._headers(idempotency_key))
        )

    def _backoff(self, attempt: int) -> None:
        s = self.settings
        self._sleep(min(s.retry_backoff_max_s, s.retry_backoff_s * (2**attempt)))

    def _get(
        self, path: str, params: dict[str, Any] | None = None, *, attempts: int | None = None
    ) -> Envelope:
        """An idempotent read, retried on transport failures only."""
        n = attempts or self.settings.read_max_attempts
        res = self._once("GET", path, params=params)
        for attempt in range(1, n):
            if res.kind == "answered" or error_code(res.envelope) in STOP_POLLING_CODES:
                break
            self._backoff(attempt - 1)
            res = self._once("GET", path, params=params)
        return res.envelope

    def _keyed_post(self, path: str, body: dict[str, Any], idempotency_key: str) -> Envelope:
        """A mutation with an Idempotency-Key: retrying with the same key is safe."""
        res = self._once("POST", path, body=body, idempotency_key=idempotency_key)
        for attempt in range(1, self.settings.train_max_attempts):
            if res.kind == "answered":
                break
            self._backoff(attempt - 1)
            res = self._once("POST", path, body=body, idempotency_key=idempotency_key)
        return res.envelope

    # --- reads --------------------------------------------------------------------------
    def health(self) -> Envelope:
        return self._get("/healthz")

    def eligibility(self, booking_id: str) -> Envelope:
        return self._get(f"/v1/bookings/{_seg(booking_id)}/eligibility")

    def run(self, run_id: str) -> Envelope:
        return self._get(f"/v1/runs/{_seg(run_id)}")

    status = run

    def find_run_by_key(self, idempotency_key: str) -> Envelope:
        return self._get("/v1/runs", {"idempotency_key": idempotency_key})

    def logs(
        self, run_id: str, cursor: str | int | None = None, limit: int | None = None
    ) -> Envelope:
        params: dict[str, Any] = {"limit": limit or self.settings.logs_page_limit}
        if cursor is not None:
            params["cursor"] = cursor
        return self._get(f"/v1/runs/{_seg(run_id)}/logs", params)

    def metrics(self, run_id: str) -> Envelope:
        return self._get(f"/v1/runs/{_seg(run_id)}/metrics")

    def checkpoints(self, run_id: str) -> Envelope:
        return self._get(f"/v1/runs/{_seg(run_id)}/checkpoints")

    # --- inspection and confirmation ----------------------------------------------------
    def plan(self, booking_id: str, manifest: ManifestBytes) -> Envelope:
        body = {
            "booking_id": booking_id,
            "manifest_b64": manifest.b64,
            "manifest_digest": manifest.digest,
        }
        # Creates nothing server-side, so a retry after an ambiguous failure is harmless.
        res = self._once("POST", "/v1/plans", body=body)
        for attempt in range(1, self.settings.read_max_attempts):
            if res.kind == "answered":
                break
            self._backoff(attempt - 1)
            res = self._once("POST", "/v1/plans", body=body)
        return res.envelope

    def confirm(
        self,
        action: str,
        booking_id: str,
        *,
        cost_usd: float,
        manifest: ManifestBytes | None = None,
        run_id: str | None = None,
        proposal_id: str | None = None,
        ttl_s: int | None = None,
    ) -> Envelope:
        """The approver's call. Not retried: a lost answer leaves at most an unused,
        short-lived reference that authorizes nothing by itself."""
        body: dict[str, Any] = {"action": action, "booking_id": booking_id, "cost_usd": cost_usd}
        if manifest is not None:
            body["manifest_b64"] = manifest.b64
            body["manifest_digest"] = manifest.digest
        if run_id is not None:
            body["run_id"] = run_id
        if proposal_id is not None:
            body["proposal_id"] = proposal_id
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        res = self._once("POST", "/v1/confirmations", body=body)
        if res.kind == "not_sent":  # never reached the server: safe to try once more
            self._backoff(0)
            res = self._once("POST", "/v1/confirmations", body=body)
        return res.envelope

    # --- train --------------------------------------------------------------------------
    def train(
        self, booking_id: str, manifest: ManifestBytes, confirmation_ref: str, idempotency_key: str
    ) -> Envelope:
        """Submit a run; never creates a second run because a response was lost."""
        body = {
            "booking_id": booking_id,
            "manifest_b64": manifest.b64,
            "manifest_digest": manifest.digest,
            "confirmation_ref": confirmation_ref,
        }
        ambiguous = False
        last: Envelope | None = None
        for attempt in range(self.settings.train_max_attempts):
            if attempt:
                self._backoff(attempt - 1)
            if ambiguous:
                # The previous POST may have created the run: look before any retry.
                found, env = self._lookup(idempotency_key, booking_id, manifest.digest)
                if found != "absent":
                    if found == "unknown":
                        last = env
                        continue  # could not look: never re-POST blindly
                    return env
            res = self._once("POST", "/v1/runs", body=body, idempotency_key=idempotency_key)
            last = res.envelope
            if res.kind == "answered":
                if ambiguous and not res.envelope.get("ok"):
                    # e.g. confirmation_consumed because our lost earlier attempt won.
                    found, env = self._lookup(idempotency_key, booking_id, manifest.digest)
                    if found in ("found", "conflict"):
                        return env
                return res.envelope
            ambiguous = ambiguous or res.kind == "ambiguous"
        if ambiguous:
            found, env = self._lookup(idempotency_key, booking_id, manifest.digest)
            if found in ("found", "conflict", "stop"):
                return env
            return error_envelope(
                ErrorCode.ambiguous_transport_failure,
                f"no answer after {self.settings.train_max_attempts} attempts and the run "
                f"could not be shown absent; look it up with the same idempotency key "
                f"(GET /v1/runs?idempotency_key=...) before submitting again",
            )
        assert last is not None
        return last

    def _lookup(
        self, idempotency_key: str, booking_id: str, digest: str
    ) -> tuple[Literal["found", "absent", "conflict", "stop", "unknown"], Envelope]:
        """Find the run created under ``idempotency_key``, as a train answer."""
        env = self.find_run_by_key(idempotency_key)
        if not env.get("ok"):
            return ("stop" if error_code(env) in STOP_POLLING_CODES else "unknown"), env
        runs = env["data"].get("runs") or []
        if not runs:
            return "absent", env
        run = dict(runs[0])
        if run.get("booking_id") != booking_id or run.get("manifest_digest") != digest:
            return "conflict", error_envelope(
                ErrorCode.idempotency_conflict,
                "the idempotency key already names a run for another booking or manifest",
                live_api_contacted=True,
            )
        run["replayed"] = True
        return "found", ok_envelope(
            run, notice="the submit's answer was lost; the run was found by its idempotency key"
        )

    # --- other mutations ----------------------------------------------------------------
    def cancel(self, run_id: str, confirmation_ref: str, idempotency_key: str) -> Envelope:
        return self._keyed_post(
            f"/v1/runs/{_seg(run_id)}/cancel",
            {"confirmation_ref": confirmation_ref},
            idempotency_key,
        )

    def cleanup(self, run_id: str, confirmation_ref: str, idempotency_key: str) -> Envelope:
        return self._keyed_post(
            f"/v1/runs/{_seg(run_id)}/cleanup",
            {"confirmation_ref": confirmation_ref},
            idempotency_key,
        )

    def decide(
        self,
        run_id: str,
        proposal_id: str,
        decision: Literal["approve", "decline"],
        confirmation_ref: str,
        idempotency_key: str,
    ) -> Envelope:
        path = f"/v1/runs/{_seg(run_id)}/proposals/{_seg(proposal_id)}/{decision}"
        return self._keyed_post(path, {"confirmation_ref": confirmation_ref}, idempotency_key)

    def release(self, booking_id: str, confirmation_ref: str, idempotency_key: str) -> Envelope:
        return self._keyed_post(
            f"/v1/bookings/{_seg(booking_id)}/release",
            {"confirmation_ref": confirmation_ref},
            idempotency_key,
        )

    # --- polling ------------------------------------------------------------------------
    def follow_status(
        self,
        run_id: str,
        on_update: Callable[[Envelope], None] | None = None,
        *,
        with_progress: bool = False,
    ) -> Envelope:
        """Poll the run until a terminal state or a stop code; returns the last envelope.

        ``with_progress`` also reads the run's metrics while it is not terminal and puts
        ``{step, loss}`` under ``data.progress`` (for a readable display).
        """
        failures = 0
        path = f"/v1/runs/{_seg(run_id)}"
        while True:
            res = self._once("GET", path)
            env = res.envelope
            if error_code(env) in STOP_POLLING_CODES:
                _notify(on_update, env)
                return env
            if res.kind == "answered":
                if not env.get("ok"):
                    _notify(on_update, env)
                    return env
                failures = 0
                if env["data"].get("state") in TERMINAL_STATES:
                    _notify(on_update, env)
                    return env
                if with_progress:
                    m = self._once("GET", f"{path}/metrics").envelope
                    if error_code(m) in STOP_POLLING_CODES:
                        _notify(on_update, m)
                        return m
                    if m.get("ok"):
                        md = m["data"]
                        step = md.get("last_step", md.get("committed_steps"))
                        env["data"]["progress"] = {"step": step, "loss": md.get("last_loss")}
                _notify(on_update, env)
            else:
                _notify(on_update, env)
                failures += 1
                if failures >= self.settings.follow_max_transport_failures:
                    return env
            self._sleep(self.settings.poll_interval_s)

    def follow_logs(
        self,
        run_id: str,
        on_entries: Callable[[list[dict[str, Any]]], None],
        cursor: str | int | None = None,
    ) -> Envelope:
        """Stream log pages until the run is terminal and drained; returns the last envelope
        (the run's, on success), with ``data.next_cursor`` set to where reading stopped."""
        failures = 0
        terminal_seen = False
        while True:
            res = self._once(
                "GET",
                f"/v1/runs/{_seg(run_id)}/logs",
                params=_drop_none({"cursor": cursor, "limit": self.settings.logs_page_limit}),
            )
            env = res.envelope
            if error_code(env) in STOP_POLLING_CODES or (res.kind == "answered" and not env["ok"]):
                return env
            if res.kind != "answered":
                failures += 1
                if failures >= self.settings.follow_max_transport_failures:
                    return env
                self._sleep(self.settings.poll_interval_s)
                continue
            failures = 0
            entries = env["data"].get("entries") or []
            if entries:
                on_entries(entries)
            cursor = env["data"].get("next_cursor", cursor)
            if len(entries) >= self.settings.logs_page_limit:
                continue  # more pages already there
            if terminal_seen:
                run_env = self.run(run_id)
                if run_env.get("ok"):
                    run_env["data"]["next_cursor"] = cursor
                return run_env
            run_env = self._once("GET", f"/v1/runs/{_seg(run_id)}").envelope
            if error_code(run_env) in STOP_POLLING_CODES:
                return run_env
            if run_env.get("ok") and run_env["data"].get("state") in TERMINAL_STATES:
                terminal_seen = True  # one more drain, then stop
                continue
            self._sleep(self.settings.poll_interval_s)


def _notify(cb: Callable[[Envelope], None] | None, env: Envelope) -> None:
    if cb is not None:
        cb(env)


def _seg(value: str) -> str:
    """A path segment: ids are opaque, so escape anything that could change the path."""
    from urllib.parse import quote

    return quote(str(value), safe="")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
