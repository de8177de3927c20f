"""The Prometheus scrape on its own listener, never on the API socket.

``/metrics`` lists every tenant's run and booking ids and gate failures, so it is not
served where tenants connect. This small HTTP server (stdlib, one daemon thread per
scrape) binds to ``Settings.metrics_host`` (loopback by default) and
``metrics_port``, answers only ``GET /metrics``, and, when the operator gives a
token file (``--metrics-token-file``), only to ``Authorization: Bearer <token>``
(compared in constant time). The token never travels on a command line.
"""

from __future__ import annotations

import errno
import hmac
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from stages.errors import ErrorCode, ItoError

log = logging.getLogger("ito.metrics")


def read_token(path: Path | None) -> str | None:
    """The scrape token from a file that nobody else can read (0600/0400)."""
    if path is None:
        return None
    if path.stat().st_mode & 0o077:
        raise PermissionError("the metrics token file must not be readable by group or others")
    token = path.read_text().strip()
    if len(token) < 16:
        raise ValueError("the metrics token must be at least 16 characters")
    return token


class MetricsListener:
    def __init__(
        self,
        render: Callable[[], tuple[bytes, str]],
        host: str,
        port: int,
        token: str | None = None,
        request_timeout_s: float = 10.0,
    ):
        self._render, self._token = render, token
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # a slow client cannot hold a thread forever

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes are frequent and carry nothing worth logging

            def _send(
                self,
                status: int,
                body: bytes,
                ctype: str = "text/plain",
                extra: dict[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self._send(404, b"not found\n")
                    return
                if not outer.authorized(self.headers.get("Authorization")):
                    self._send(
                        401,
                        b"unauthorized\n",
                        extra={"WWW-Authenticate": 'Bearer realm="ito-metrics"'},
                    )
                    return
                try:
                    body, ctype = outer._render()
                except Exception:
                    log.exception("metrics rendering failed")
                    self._send(500, b"error\n")
                    return
                self._send(200, body, ctype)

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            # The usual cause: a second `ito-backend serve` on the host, same default port.
            raise ItoError(
                ErrorCode.address_in_use,
                f"the metrics port {host}:{port} is already in use (another "
                "ito-backend serve on this host?): pass --metrics-port PORT, or "
                "--metrics-port 0 to pick a free one",
            ) from None
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    def authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        expected = f"Bearer {self._token}".encode()
        return hmac.compare_digest(expected, (header or "").encode())

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> MetricsListener:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="ito-metrics",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
