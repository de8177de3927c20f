"""The API's HTTP server: uvicorn (h11) with the bounds a shared network needs.

uvicorn alone bounds neither open connections nor the time a client may take to send
its request head: a socket that opens and sends nothing is held forever, and enough of
them exhaust the process's descriptors (accept() then fails for every tenant, and
asyncio logs each failure). ``GuardedH11Protocol`` adds, per connection:

* a cap on open connections (``max_connections``, clamped to the descriptor limit):
  at the cap the oldest connection still waiting for a request head is closed for the
  new one, so half-open sockets cannot lock out a client that sends a request;
* a header deadline (``header_timeout_s``) from the connection's opening or its
  previous response to a complete request head, not reset by each byte (slowloris);
* a body deadline (``body_timeout_s``) from the head to the body's end.

Protocol-level log lines (uvicorn's, asyncio's, these closures) are rate limited per
kind (``LogRateLimit``), so a flood grows the log by a bounded amount.
``build_server`` is the one way ``ito-backend serve`` builds its server.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
import time
from collections import OrderedDict
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from orchestrator.settings import Settings

log = logging.getLogger("ito.api.http")
# The loggers whose lines a remote client can cause at will.
PROTOCOL_LOGGERS = ("uvicorn.error", "asyncio", "ito.api.http")
# Message kinds a rate limit remembers at most (least recently seen dropped).
MAX_LOG_KINDS = 1024


class LogRateLimit(logging.Filter):
    """At most ``burst`` records per kind (logger and message template) per window;
    the first record of the next window says how many were dropped."""

    def __init__(self, burst: int, window_s: float):
        super().__init__()
        self.burst, self.window_s = burst, window_s
        # kind -> [window start, records passed, records dropped]
        self._kinds: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is None or now - seen[0] >= self.window_s:
                dropped = int(seen[2]) if seen is not None else 0
                self._kinds[kind] = [now, 1, 0]
                self._kinds.move_to_end(kind)
                while len(self._kinds) > MAX_LOG_KINDS:
                    self._kinds.popitem(last=False)
                if dropped:
                    record.msg = (
                        f"{record.msg} [{dropped} more like this in the last "
                        f"{self.window_s:g} s not logged]"
                    )
                return True
            if seen[1] < self.burst:
                seen[1] += 1
                return True
            seen[2] += 1
            return False


class ConnectionBook:
    """The open connections of one server, oldest first, and which of them wait for
    a request head (those may be closed to admit a new connection at the cap)."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.open: dict[GuardedH11Protocol, None] = {}
        self.waiting: dict[GuardedH11Protocol, None] = {}
        self.closed = {"refused": 0, "evicted": 0, "header_timeout": 0, "body_timeout": 0}

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Whether ``conn`` may stay open (an older waiting one is closed if need be)."""
        if len(self.open) >= self.max_connections:
            victim = next(iter(self.waiting), None)
            if victim is None:
                self.closed["refused"] += 1
                log.warning(
                    "connection refused: %d connections open, none waiting for a request",
                    len(self.open),
                )
                return False
            self.closed["evicted"] += 1
            log.warning(
                "connection limit %d reached: closing the oldest one waiting for a request",
                self.max_connections,
            )
            victim.close_connection()
        self.open[conn] = None
        return True

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)
        self.waiting.pop(conn, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and header and body deadlines.
    ``guarded_protocol`` makes the subclass that carries one server's book and limits."""

    book: ClassVar[ConnectionBook]
    header_timeout_s: ClassVar[float]
    body_timeout_s: ClassVar[float]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: Any = None  # the h11 state the deadline was armed for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.book.admit(self):
            self.transport.close()
            return
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.book.forget(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def close_connection(self) -> None:
        self.book.forget(self)
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    # -- deadlines ----------------------------------------------------------------------
    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._deadline_for = None

    def _watch(self) -> None:
        """Arm the deadline of the request phase the connection is in; a phase keeps the
        deadline it started with (bytes that arrive do not extend it)."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # waiting for (the rest of) a request head
            self.book.waiting[self] = None
            timeout, kind = self.header_timeout_s, "header_timeout"
        elif state is h11.SEND_BODY:
            self.book.waiting.pop(self, None)
            timeout, kind = self.body_timeout_s, "body_timeout"
        else:  # the request is in; the handler has it (its own bounds apply)
            self.book.waiting.pop(self, None)
            self._disarm()
            return
        if self._deadline_for == kind:
            return
        self._disarm()
        self._deadline_for = kind
        self._deadline = self.loop.call_later(timeout, self._expire, kind, timeout)

    def _expire(self, kind: str, timeout: float) -> None:
        self._deadline = self._deadline_for = None
        if self.transport.is_closing():
            return
        self.book.closed[kind] += 1
        what = "request head" if kind == "header_timeout" else "request body"
        log.warning("connection closed: no complete %s within %.0f s", what, timeout)
        self.close_connection()


def guarded_protocol(
    max_connections: int, header_timeout_s: float, body_timeout_s: float
) -> type[GuardedH11Protocol]:
    """A protocol class for one server: its own connection book and deadlines."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "book": ConnectionBook(max_connections),
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
        },
    )


def connection_cap(settings: Settings) -> int:
    """``max_connections``, after raising the descriptor limit toward what it needs
    (up to the hard limit) and clamping it to what the limit allows: the process never
    runs out of descriptors for want of a connection cap (accept() failing for all)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Beyond the capped connections: one accept burst, plus one more accepted while the
    # connections the previous burst displaced are still closing.
    spare = settings.fd_reserve + 2 * settings.listen_backlog
    want = settings.max_connections + spare
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    cap = settings.max_connections
    if soft != resource.RLIM_INFINITY and soft - spare < cap:
        cap = max(8, soft - spare)
        log.warning(
            "descriptor limit %d: at most %d client connections (max_connections %d)",
            soft,
            cap,
            settings.max_connections,
        )
    return cap


def limit_protocol_logs(settings: Settings) -> LogRateLimit:
    limiter = LogRateLimit(settings.protocol_log_burst, settings.protocol_log_window_s)
    for name in PROTOCOL_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, LogRateLimit)]:
            logger.removeFilter(f)
        logger.addFilter(limiter)
    return limiter


def build_server(
    app: Any, settings: Settings, *, host: str, port: int, log_level: str
) -> uvicorn.Server:
    """The API's uvicorn server with the connection cap, deadlines and log limits."""
    protocol = guarded_protocol(
        connection_cap(settings), settings.header_timeout_s, settings.body_timeout_s
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        backlog=settings.listen_backlog,
        log_level=log_level,
        access_log=True,
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout_s)),
        timeout_graceful_shutdown=int(max(1, settings.shutdown_grace_s)),
    )
    # uvicorn configures its loggers in Config(); the filters go on afterwards.
    limit_protocol_logs(settings)
    return uvicorn.Server(config)
