"""The client's HTTP exchange with the API server: bounded timeouts, each failure
classified by whether the request may have reached the server, and bounded retries.

* every call has a bounded connect timeout and a bounded *total* timeout (the
  whole request, not each socket read), see ``ClientSettings``;
* a request is classified after a failure: ``not_sent`` (connect refused, DNS,
  connect timeout: safe to retry) or ``ambiguous`` (the request may have reached
  the server: read timeout, connection reset after the request was written, a
  non-envelope 5xx from a proxy, a 5xx envelope);
* an idempotent read is retried on transport failures only, a keyed mutation with
  its same idempotency key, both with exponential backoff.

``ApiTransport`` drives an asyncio loop of its own (httpx's async client is what
makes the total timeout exact: the request task is cancelled at the deadline); use
one per thread, not from inside a running event loop. ``ItoClient``
(``orchestrator/client/api.py``) is the API's calls on top of it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Self
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.client.credentials import ApiKey
from orchestrator.client.envelope import (
    STOP_POLLING_CODES,
    Envelope,
    error_code,
    error_envelope,
    is_envelope,
)
from stages.errors import ErrorCode

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


class ApiTransport:
    """One server, one key: requests with the contract's timeouts and retry rules."""

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

    def __enter__(self) -> Self:
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
