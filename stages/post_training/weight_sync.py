"""How a policy version reaches the rollout fleet: two paths behind one seam.

Every worker receives a version through ``RolloutWorker.set_weights(version,
weights)``. On the engine, the learner's rank 0 publishes each version itself
(``stages.post_training.weight_board``) and the driver forwards only a small
descriptor, never the tensors:

- ``object_store``: :class:`ObjectStoreWeights`, the ``ObjectRef`` of one ``ray.put``
  made in rank 0's process, nested in the descriptor so that Ray does not resolve it
  in transit: each worker fetches it itself (and keeps its version if the object is
  gone, e.g. rank 0 died and took the object it owned with it). Ray's own transfer,
  behind Ray's token authentication;
- ``collective``: :class:`CollectiveWeights` (where to connect, how to rebuild); the
  bytes go from the publishing rank to every worker over the sender's own listener.
  The state is packed per dtype into flat buckets of at most ``bucket_bytes``, sent
  to every worker at once as one frame per version, and rebuilt from the
  descriptor's metadata. A new publisher (a healed rank 0) has a new listener, and
  workers connect to it on their first version from it;
- version 0 is :class:`BaseWeights`: every worker loads the base HF folder itself.

Who can receive the weights. Itô's network is shared: any tenant's job can reach a
node's ports. The sender's listener binds the node's cluster address (never a
wildcard) on a port of the deployment's range (``stages.netsec.listener_config``),
and a peer gets a byte of a version only after the mutual challenge-response over
the run's weight-sync key (``RunSecret.derive("weight-sync")``, ``stages.netsec``):
a stranger that connects is closed after the handshake fails (or after
``handshake_timeout_s`` of silence), never counted as a worker and never sent a
frame; a worker refuses a listener that cannot prove the key (a fake sender) before
it reads a byte. The key reaches the publishing rank and the workers only through Ray
(the workers' actor arguments, the weight board's answer to the rank), never an
environment, a file, a log or an event, and it is never sent on the listener.

Why not a torch process group. The path used to be a gloo (NCCL on CUDA) broadcast
over a ``TCPStore`` rendezvous. A ``TCPStore`` admits anyone who connects: a stranger
can read the rendezvous keys and join as a rank (one did, and received the weights),
and gloo's pair listeners and NCCL's bootstrap take peers by address and sequence
number, with no proof of the run's secret. Wrapping the store would leave those
listeners open, so the bytes go over a socket of this module's own, where every
connection is proven first. The cost: on CUDA the buckets go through host memory and
TCP (no NCCL), and the sender's link carries one copy per worker (a broadcast tree
would carry fewer).

The controller tests' in-process learner hands the pool a state dict instead, which
``put_weights`` turns into the same descriptors.

A version must reach every worker, so the sender's side runs on its own thread, one
version at a time in publish order: it waits (up to ``timeout_s``) until every
worker has connected and proven the key, then writes the version's frame to all of
them at once; a worker still generating reads it when its rollout ends (its calls
run in order) and the learner is not held up. The controller sends every version to
every worker, so each worker reads the same sequence of frames; a frame names its
version's descriptor (``tag``), so a worker never loads another version's bytes. A
sender that dies mid-frame fails the workers' receive (the connection closes, or
``timeout_s``): each keeps its version and connects to the next sender. A worker whose
receive failed closes its connection and connects again for the next version. Not
handled here: a worker that dies for good leaves the sender short of a connection;
the next version then waits ``timeout_s`` and fails (the object-store path survives
worker restarts).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import secrets
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

from stages.netsec import (
    PeerRefused,
    RunSecret,
    accept_peer,
    bind_listener,
    cluster_address,
    listener_config,
    prove_to_peer,
)
from stages.post_training.weight_descriptors import (
    CollectiveWeights,
    pack,
    plan_buckets,
    state_digest,
    torch_dtype,
    unpack,
)

if TYPE_CHECKING:
    import torch

# The purpose the weight-sync key is derived for (``RunSecret.derive``): a proof for
# the weight sync is no proof on any other listener of the run.
SYNC_PURPOSE = "weight-sync"


def sync_key(secret: RunSecret) -> bytes:
    """The run's weight-sync key: what the learner's rank 0 and the workers prove."""
    return secret.derive(SYNC_PURPOSE)


# A frame: the version's tag (``CollectiveWeights.tag``) and its byte count, then the
# buckets' bytes in order. After the handshake a worker sends its rank (4 bytes).
_FRAME = struct.Struct("!16sQ")
_RANK = struct.Struct("!I")
TAG_BYTES = 16
# Bytes per socket read or write (the kernel's buffers are smaller; more buys nothing).
CHUNK_BYTES = 4 << 20
# Handshakes under way at once on a sender's listener: a flood of strangers'
# connections holds at most this many threads (each for at most the handshake
# timeout); a connection beyond it is closed at once (a worker then misses a version
# and connects again for the next).
MAX_HANDSHAKES = 64


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    import torch

    return t.view(torch.uint8).numpy().data.cast("B")


def _send_frame(
    sock: socket.socket, tag: bytes, flats: list[torch.Tensor], timeout_s: float
) -> None:
    sock.settimeout(timeout_s)
    views = [_byte_view(t) for t in flats]
    sock.sendall(_FRAME.pack(tag, sum(len(v) for v in views)))
    for v in views:
        for at in range(0, len(v), CHUNK_BYTES):
            sock.sendall(v[at : at + CHUNK_BYTES])


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + CHUNK_BYTES])
        if n == 0:
            raise ConnectionError("the sender closed the connection mid-version")
        got += n


class CollectiveSender:
    """The learner's end (rank 0): the listener workers connect to, and the thread
    that writes each version's frame to every proven worker."""

    def __init__(
        self,
        *,
        workers: int,
        key: bytes,
        device: str,
        bucket_bytes: int,
        timeout_s: float,
        host: str | None = None,
    ):
        self.world = workers + 1
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._key = key
        self._listener_cfg = listener_config()
        # The node's cluster address, never a wildcard (a test passes loopback).
        self.host = host or cluster_address()
        self._listener = bind_listener(self.host, self._listener_cfg)
        self.port = int(self._listener.getsockname()[1])
        self._peers: dict[int, socket.socket] = {}  # worker rank -> proven connection
        self._changed = threading.Condition()
        self._closed = False
        self.refused = 0  # connections that did not prove the key
        self._ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self._fan = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weight-send")
        self._pending: list[cf.Future[None]] = []
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        threading.Thread(target=self._accept, name="weight-sync-accept", daemon=True).start()

    # -- who may receive ---------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):
                with self._changed:
                    self.refused += 1
                conn.close()
                continue
            # Each handshake on a thread of its own: a silent stranger holds no one up.
            threading.Thread(
                target=self._admit, args=(conn,), name="weight-sync-admit", daemon=True
            ).start()

    def _admit(self, conn: socket.socket) -> None:
        try:
            self._handshake(conn)
        finally:
            self._handshakes.release()

    def _handshake(self, conn: socket.socket) -> None:
        timeout = self._listener_cfg.handshake_timeout_s
        try:
            accept_peer(conn, self._key, timeout)
            conn.settimeout(timeout)
            rank = _RANK.unpack(conn.recv(_RANK.size, socket.MSG_WAITALL))[0]
            if not 1 <= rank < self.world:
                raise PeerRefused(f"no worker rank {rank}")
        except (PeerRefused, OSError, struct.error):
            with self._changed:
                self.refused += 1
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._changed:
            old = self._peers.pop(rank, None)
            if self._closed:
                conn.close()
            else:
                self._peers[rank] = conn  # a worker that reconnects replaces its old one
            self._changed.notify_all()
        if old is not None:
            old.close()

    def proven(self) -> list[int]:
        """The worker ranks connected and proven now."""
        with self._changed:
            return sorted(self._peers)

    # -- versions ----------------------------------------------------------------------
    def describe(self, state: dict[str, torch.Tensor]) -> CollectiveWeights:
        tensors, buckets = plan_buckets(state, self.bucket_bytes)
        return CollectiveWeights(
            host=self.host,
            port=self.port,
            world=self.world,
            tag=secrets.token_bytes(TAG_BYTES),
            timeout_s=self.timeout_s,
            handshake_timeout_s=self._listener_cfg.handshake_timeout_s,
            tensors=tensors,
            buckets=buckets,
        )

    def pack(self, state: dict[str, torch.Tensor], desc: CollectiveWeights) -> list[torch.Tensor]:
        """The flat buckets of ``state`` in host memory (copies: the learner trains on)."""
        return pack(state, desc, "cpu")

    def send(self, desc: CollectiveWeights, flats: list[torch.Tensor]) -> None:
        """Queue one version's frame (every worker must receive it, in order)."""
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._ex.submit(self._send, desc.tag, flats))

    def put(self, state: dict[str, torch.Tensor]) -> CollectiveWeights:
        desc = self.describe(state)
        self.send(desc, self.pack(state, desc))
        return desc

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued version has gone out (raises its error)."""
        for f in self._pending:
            f.result(timeout=timeout_s)

    def _send(self, tag: bytes, flats: list[torch.Tensor]) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._changed:  # every worker connected and proven
            while len(self._peers) < self.world - 1 and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"weight sync: {len(self._peers)} of {self.world - 1} workers "
                        f"connected within {self.timeout_s:.0f}s"
                    )
                self._changed.wait(left)
            if self._closed:
                return
            peers = dict(self._peers)
        sends = {
            rank: self._fan.submit(_send_frame, conn, tag, flats, self.timeout_s)
            for rank, conn in peers.items()
        }
        failed = []
        for rank, fut in sends.items():
            try:
                fut.result()
            except OSError as e:  # that worker is gone or stuck: it connects again
                failed.append(f"worker {rank}: {type(e).__name__}")
                with self._changed:
                    if self._peers.get(rank) is peers[rank]:
                        del self._peers[rank]
                peers[rank].close()
        if failed:
            raise ConnectionError("weight sync: " + ", ".join(failed))

    def close(self) -> None:
        for f in self._pending:
            if not f.done():
                f.cancel()
        with self._changed:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            self._changed.notify_all()
        # shutdown wakes the accept() blocked on the listener; close alone does not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in peers:
            conn.close()
        self._ex.shutdown(wait=False, cancel_futures=True)
        self._fan.shutdown(wait=False, cancel_futures=True)


class CollectiveReceiver:
    """A worker's end (rank ``index + 1``): connects on its first version, proves the
    key and checks the sender proves it back before it reads a byte."""

    def __init__(self, rank: int, key: bytes):
        self.rank = rank
        self._key = key
        self._sock: socket.socket | None = None
        self._joined: tuple[str, int] | None = None  # the sender's listener

    def leave(self) -> None:
        """Close the connection (after a failed receive): the next version reconnects."""
        if self._sock is not None:
            self._sock.close()
        self._sock = self._joined = None

    def _connect(self, desc: CollectiveWeights) -> socket.socket:
        sock = socket.create_connection((desc.host, desc.port), timeout=desc.timeout_s)
        try:
            prove_to_peer(sock, self._key, desc.handshake_timeout_s)
            sock.sendall(_RANK.pack(self.rank))
        except BaseException:
            sock.close()
            raise
        return sock

    def receive(self, desc: CollectiveWeights) -> dict[str, torch.Tensor]:
        """The version ``desc`` describes, as CPU tensors. Raises ``ConnectionError``
        (``PeerRefused`` for a sender without the key) or ``TimeoutError``; the
        connection is closed then, and nothing of the version is returned."""
        import torch

        if self._joined != (desc.host, desc.port):  # a new sender (a healed rank 0)
            self.leave()
        try:
            if self._sock is None:
                self._sock = self._connect(desc)
                self._joined = (desc.host, desc.port)
            sock = self._sock
            sock.settimeout(desc.timeout_s)
            header = bytearray(_FRAME.size)
            _recv_into(sock, memoryview(header))
            tag, size = _FRAME.unpack(bytes(header))
            if tag != desc.tag or size != desc.bytes:
                raise ConnectionError("weight sync: the frame is not this version's")
            flats = [torch.empty(n, dtype=torch_dtype(dt)) for dt, n in desc.buckets]
            for t in flats:
                _recv_into(sock, _byte_view(t))
        except TimeoutError:
            self.leave()
            raise
        except OSError as e:
            self.leave()
            if isinstance(e, ConnectionError):
                raise
            raise ConnectionError(f"weight sync: {type(e).__name__}: {e}") from e
        return unpack(flats, desc)


# ``unpack`` and ``state_digest`` are also read from here by the out-of-process test
# helpers (a sender that dies mid-frame, a stranger on the listener).
__all__ = [
    "SYNC_PURPOSE",
    "CollectiveReceiver",
    "CollectiveSender",
    "state_digest",
    "sync_key",
    "unpack",
]
