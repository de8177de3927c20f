"""A small real HTTP/1.1 proxy on loopback that records requests and injects faults.

It sits between the client and the server (or in front of nothing, as a recorder).
Per request a ``decide(method, path, n)`` callback picks what happens:

* ``"forward"``: forward the request, relay the response;
* ``"drop"``: forward the request, read the server's full response, then close the
  client's connection without sending a byte (a response lost after the server
  committed the work);
* ``"502"``: forward the request, then answer a non-envelope 502 as a load balancer
  would;
* ``"hold"``: forward the request, then keep the answer until the client gives up
  (its read times out);
* ``"refuse"``: close the connection without forwarding (the request never reached
  the server).

Every request is recorded (method, path with query, action, upstream status, and
the time it arrived), so tests can prove what reached, or did not reach, the
server. Only Content-Length bodies are handled (what httpx and uvicorn send for
JSON); that is all this test proxy needs.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

Decide = Callable[[str, str, int], str]
_READ_TIMEOUT_S = 30.0


@dataclass
class Recorded:
    method: str
    path: str
    action: str
    arrived: float
    status: int | None = None
    body: bytes = b""


def _read_message(rfile, *, is_response: bool) -> tuple[bytes, bytes] | None:
    """One HTTP message: (head incl. CRLFCRLF, body), or None at EOF."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = rfile.readline(65537)
        if not line:
            return None
        head += line
        if head == b"\r\n":  # tolerate a stray CRLF between messages
            head = b""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = rfile.read(length) if length else b""
    return head, body


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.connection.settimeout(_READ_TIMEOUT_S)
        while True:
            try:
                msg = _read_message(self.rfile, is_response=False)
            except (OSError, ValueError):
                return
            if msg is None:
                return
            head, body = msg
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, path, _ = request_line.split(" ", 2)
            proxy = self.server.owner
            with proxy.lock:
                n = len(proxy.requests)
                rec = Recorded(method, path, "", time.monotonic(), body=body)
                proxy.requests.append(rec)
            rec.action = proxy.decide(method, path, n)
            if rec.action == "refuse":
                return
            response = proxy.forward(head, body)
            rec.status = response[2] if response else None
            if rec.action == "hold":
                # Wait for the client to hang up (recv returns b"" or fails), then drop.
                try:
                    self.connection.settimeout(_READ_TIMEOUT_S)
                    self.connection.recv(1)
                except OSError:
                    pass
                return
            if rec.action == "drop":
                # The server did the work and answered; the client never hears it.
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if rec.action == "502" or response is None:
                page = b"<html><body>502 Bad Gateway</body></html>"
                self.wfile.write(
                    b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(page) + page
                )
                return
            self.wfile.write(response[0] + response[1])
            self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: RecordingProxy


class RecordingProxy:
    """``with RecordingProxy(upstream_port) as p: ... p.url ... p.requests``."""

    def __init__(self, upstream_port: int | None, decide: Decide | None = None):
        self.upstream_port = upstream_port
        self.decide: Decide = decide or (lambda _m, _p, _n: "forward")
        self.requests: list[Recorded] = []
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def forward(self, head: bytes, body: bytes) -> tuple[bytes, bytes, int] | None:
        if self.upstream_port is None:
            return None
        try:
            with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30) as up:
                up.sendall(head + body)
                rfile = up.makefile("rb")
                msg = _read_message(rfile, is_response=True)
        except OSError:
            return None
        if msg is None:
            return None
        rhead, rbody = msg
        status = int(rhead.split(b" ", 2)[1])
        return rhead, rbody, status

    def matching(self, method: str, prefix: str) -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.method == method and r.path.startswith(prefix)]

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
