"""How a healing group fetches a live peer's state: torchft's ``CheckpointTransport``
over a socket of our own, where both ends prove the run's secret first.

torchft's default (``HTTPTransport``) binds every interface, serves the state to
whoever asks for ``/checkpoint/<step>/full``, and loads with ``weights_only=False``:
any process on the network can read the weights, and a fake peer that reaches a heal
(it only takes a forged ``checkpoint_metadata`` in a quorum) makes the rank unpickle
its bytes. Here:

- the server binds the node's cluster address, on a port of the deployment's range;
- a connection is served only after ``accept_peer`` with the run's heal key; the
  client proves the same key and refuses a server that cannot prove it back, before
  it reads a byte of payload (``stages.netsec``);
- the client loads with ``weights_only=True``: even a peer that holds the secret
  gets no code run, only tensors and plain containers. A heal's state is tensors,
  ints, floats, bools, strings, ``None`` and lists/tuples/dicts of them (the model's
  and AdamW's state dicts, the loop's windows, torchft's step counters).

One connection per heal per rank, after the quorum asked for it; the ordinary step
never touches this transport.

Wire, after the handshake: the client sends the step (8 bytes, big-endian); the
server answers ``OK`` and the state in ``torch.distributed._serialization``'s
streaming format, or ``NO`` and a reason (a step it does not serve).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

import torch
from torch.distributed._serialization import _streaming_load, _streaming_save
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchft.checkpointing._rwlock import RWLock
from torchft.checkpointing.transport import CheckpointTransport

from stages.netfront import host_port
from stages.netsec import (
    ListenerConfig,
    PeerRefused,
    accept_peer,
    bind_listener,
    prove_to_peer,
    recv_exact,
)
from stages.run_secret import RunSecret

log = logging.getLogger(__name__)

# The purpose the heal key is derived for: a proof for another listener is none here.
HEAL_PURPOSE = "heal"
_STEP = struct.Struct("!q")
OK, NO = b"OK", b"NO"
# A refusal's reason is at most this long (the client reads no more).
_REASON_BYTES = 512


class HealRefused(ConnectionError):
    """The heal source answered but does not serve the step asked for."""


def _split_address(metadata: str) -> tuple[str, int]:
    host, _, port = metadata.rpartition(":")
    return host.strip("[]"), int(port)


def _to_cpu(state: Any) -> Any:
    """The state with every tensor on the CPU (a heal is served from host memory, so
    the device's copy may change while it is sent: torchft disallows sending first)."""
    values, spec = tree_flatten(state)
    moved = [
        v.cpu() if isinstance(v, torch.Tensor) and v.device.type != "cpu" else v for v in values
    ]
    return tree_unflatten(moved, spec)


class HealTransport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]  # torchft: untyped
    """One rank's heal server and client (torchft's ``Manager(checkpoint_transport=)``).

    ``metadata()`` is what torchft hands a healing peer through the quorum:
    ``host:port`` of this rank's server. The server serves only the step torchft
    allowed (``send_checkpoint``) and blocks requests while torchft disallows it,
    as torchft's own transport does."""

    def __init__(
        self,
        secret: RunSecret,
        listener: ListenerConfig,
        *,
        host: str,
        timeout: timedelta,
        max_connections: int,
    ):
        self._key = secret.derive(HEAL_PURPOSE)
        self._listener = listener
        self._timeout = timeout
        self._lock = RWLock(timeout=timeout.total_seconds())
        self._disallowed = False
        self._step = -1
        self._state: Any = None
        # A stranger's connection holds a slot for at most the handshake timeout; beyond
        # this many at once, connections are closed unserved.
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = threading.Event()
        # Nothing is served before the first send_checkpoint (step -1 is no state).
        self.disallow_checkpoint()
        self._sock = bind_listener(host, listener)
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._serve, name="heal-server", daemon=True)
        self._thread.start()

    # --- server ---------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def metadata(self) -> str:
        return host_port(*self.address())

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _peer = self._sock.accept()
            except OSError:
                return  # the listener was closed (shutdown)
            if not self._slots.acquire(blocking=False):
                conn.close()  # a flood: the run's own peers retry at the next quorum
                continue
            threading.Thread(
                target=self._handle, args=(conn,), name="heal-send", daemon=True
            ).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                try:
                    accept_peer(conn, self._key, self._listener.handshake_timeout_s)
                except PeerRefused:
                    return  # a stranger: nothing read, nothing sent
                conn.settimeout(self._timeout.total_seconds())
                (step,) = _STEP.unpack(recv_exact(conn, _STEP.size))
                # Blocks while torchft disallows sending (the state may be changing).
                with self._lock.r_lock():
                    if step != self._step:
                        conn.sendall(NO + f"serving step {self._step}, not {step}".encode())
                        return
                    conn.sendall(OK)
                    with conn.makefile("wb") as f:
                        _streaming_save(self._state, f)
        except Exception as e:  # one failed send must not end the server
            log.warning("heal send failed: %s: %s", type(e).__name__, e)
        finally:
            self._slots.release()

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
    ) -> None:
        self._state = _to_cpu(state_dict)
        self._step = step
        if self._disallowed:
            self._disallowed = False
            self._lock.w_release()

    def disallow_checkpoint(self) -> None:
        """Wait for the sends under way, then block new ones until the next
        ``send_checkpoint`` (torchft then mutates the state)."""
        if not self._disallowed:
            self._disallowed = True
            self._lock.w_acquire()
            self._state = None

    def shutdown(self, wait: bool = True) -> None:
        self._closed.set()
        # shutdown() wakes the accept() of the server thread; close() alone may not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if wait:
            self._thread.join(timeout=self._timeout.total_seconds())

    # --- client ---------------------------------------------------------------------
    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        """The state of ``step`` from the server named by ``metadata``; ``PeerRefused``
        when it cannot prove the run's secret (nothing of its payload is read)."""
        return fetch_heal_state(
            self._key,
            metadata,
            step,
            timeout=timeout,
            handshake_timeout_s=self._listener.handshake_timeout_s,
        )


def fetch_heal_state(
    key: bytes,
    metadata: str,
    step: int,
    *,
    timeout: timedelta,
    handshake_timeout_s: float,
) -> dict[str, Any]:
    """Client side of ``HealTransport``: prove ``key``, require the server's proof, ask
    for ``step``, load what comes with ``weights_only=True``."""
    host, port = _split_address(metadata)
    with socket.create_connection((host, port), timeout=timeout.total_seconds()) as conn:
        prove_to_peer(conn, key, handshake_timeout_s)
        conn.settimeout(timeout.total_seconds())
        conn.sendall(_STEP.pack(step))
        status = recv_exact(conn, len(OK))
        if status != OK:
            reason = conn.recv(_REASON_BYTES).decode(errors="replace")
            raise HealRefused(f"heal source {metadata} refused step {step}: {reason}")
        with conn.makefile("rb") as f:
            state = _streaming_load(f, weights_only=True)
    if not isinstance(state, dict):
        raise HealRefused(f"heal source {metadata} sent a {type(state).__name__}, not a state")
    return state
