"""Free local TCP ports for the processes this host starts (API server, Ray head)."""

from __future__ import annotations

import socket
import threading

# Ports handed out by this process: the kernel may offer a port it just offered again
# (nothing bound it yet), and two of a server's listeners on one port fail its start.
_given: set[int] = set()
_lock = threading.Lock()
# Attempts at a port not handed out before (the ephemeral range has thousands).
ATTEMPTS = 64


def free_port() -> int:
    """A port nothing listens on now, never one this process handed out before (it
    may still be taken by another process before its user binds it)."""
    with _lock:
        for _ in range(ATTEMPTS):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _given:
                _given.add(port)
                return port
    raise OSError(f"no new free port in {ATTEMPTS} attempts")
