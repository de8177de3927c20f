"""How a policy version reaches the rollout fleet: two paths behind one seam.

Every worker receives a version through ``RolloutWorker.set_weights(version,
weights)``. On the engine, the learner's rank 0 publishes each version itself
(``stages.post_training.weight_board``) and the driver forwards only a small
descriptor, never the tensors:

- ``object_store``: :class:`ObjectStoreWeights`, the ``ObjectRef`` of one ``ray.put``
  made in rank 0's process, nested in the descriptor so that Ray does not resolve it
  in transit: each worker fetches it itself (and keeps its version if the object is
  gone, e.g. rank 0 died and took the object it owned with it);
- ``collective``: :class:`CollectiveWeights` (where to join, how to rebuild); the
  bytes go through a torch.distributed process group (gloo on CPU, NCCL on CUDA) in
  which the publishing rank is rank 0 and rollout worker ``n`` is rank ``n + 1``. The
  state is packed per dtype into flat buckets of at most ``bucket_bytes`` and each
  bucket is broadcast from rank 0; workers rebuild the state dict from the
  descriptor's metadata. A new publisher (a healed rank 0) has a new rendezvous
  address, and workers join its group on their first version from it;
- version 0 is :class:`BaseWeights`: every worker loads the base HF folder itself.

The controller tests' in-process learner hands the pool a state dict instead, which
``put_weights`` turns into the same descriptors.

A broadcast needs every rank, so the sender's side runs on its own thread, one
version at a time in publish order: a worker still generating joins when its rollout
ends (its calls run in order) and the learner is not held up. The controller sends
every version to every worker, so each worker consumes the same sequence of
broadcasts. A sender that dies mid-broadcast fails the workers' receive (the peer's
connection closes, or ``timeout_s``): each keeps its version and joins the next
sender's rendezvous. Not handled here: a worker that dies leaves the group short of a rank;
the collective then times out (``timeout_s``) and the run fails (the object-store
path survives worker restarts).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import hashlib
from dataclasses import dataclass
from typing import Any, Literal

WeightSync = Literal["object_store", "collective"]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32" (torch.<dtype>)
    bucket: int
    offset: int  # in elements of the bucket's dtype


@dataclass(frozen=True)
class ObjectStoreWeights:
    """The object-store path's descriptor: where the state dict is, and its size."""

    ref: Any  # ray.ObjectRef of the state dict (owned by the process that put it)
    bytes: int


@dataclass(frozen=True)
class BaseWeights:
    """Version 0: the weights of the base HF folder, which each worker loads itself."""

    model_dir: str


@dataclass(frozen=True)
class CollectiveWeights:
    """The descriptor a worker gets instead of the weights on the collective path."""

    host: str
    port: int
    world: int
    backend: Literal["gloo", "nccl"]
    timeout_s: float
    tensors: tuple[TensorMeta, ...]
    buckets: tuple[tuple[str, int], ...]  # (dtype, elements) per bucket, in order

    @property
    def bytes(self) -> int:
        return sum(n * _dtype(dt).itemsize for dt, n in self.buckets)


@dataclass(frozen=True)
class PublishedVersion:
    """What the learner's rank 0 reports for a committed version: a descriptor of
    weights that stay in its process (or the object store), the step's loss and the
    seconds it took to put or pack them there."""

    version: int
    weights: ObjectStoreWeights | CollectiveWeights
    loss: float
    put_s: float


Descriptor = ObjectStoreWeights | CollectiveWeights | BaseWeights


def state_bytes(state: dict[str, Any]) -> int:
    return sum(int(t.numel()) * t.element_size() for t in state.values())


def _dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name)
    assert isinstance(dt, torch.dtype)
    return dt


def plan_buckets(
    state: dict[str, Any], bucket_bytes: int
) -> tuple[tuple[TensorMeta, ...], tuple[tuple[str, int], ...]]:
    """Pack tensors of one dtype into buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own)."""
    metas: list[TensorMeta] = []
    buckets: list[tuple[str, int]] = []
    open_bucket: dict[str, int] = {}  # dtype -> index of its bucket being filled
    for name in sorted(state):
        t = state[name]
        dt = str(t.dtype).removeprefix("torch.")
        n = int(t.numel())
        b = open_bucket.get(dt)
        if b is None or (buckets[b][1] + n) * t.element_size() > bucket_bytes:
            b = len(buckets)
            buckets.append((dt, 0))
            open_bucket[dt] = b
        metas.append(TensorMeta(name, tuple(t.shape), dt, b, buckets[b][1]))
        buckets[b] = (dt, buckets[b][1] + n)
    return tuple(metas), tuple(buckets)


def pack(state: dict[str, Any], desc: CollectiveWeights, device: str) -> list[Any]:
    """The flat buckets (copies: the learner changes its tensors on the next step)."""
    import torch

    flats = [torch.empty(n, dtype=_dtype(dt), device=device) for dt, n in desc.buckets]
    for m in desc.tensors:
        t = state[m.name].detach()
        flats[m.bucket][m.offset : m.offset + t.numel()].copy_(t.reshape(-1))
    return flats


def unpack(flats: list[Any], desc: CollectiveWeights) -> dict[str, Any]:
    out = {}
    for m in desc.tensors:
        n = 1
        for d in m.shape:
            n *= d
        out[m.name] = flats[m.bucket][m.offset : m.offset + n].view(m.shape)
    return out


def state_digest(state: dict[str, Any]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (bit-identity check)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\t{t.dtype}\t{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _group(store: Any, rank: int, world: int, backend: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    prefixed = dist.PrefixStore("weight-sync", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


class CollectiveSender:
    """The learner's end (rank 0): hosts the rendezvous store and broadcasts."""

    def __init__(
        self, *, workers: int, host: str, device: str, bucket_bytes: int, timeout_s: float
    ):
        import torch.distributed as dist

        self.world = workers + 1
        self.device = device
        self.backend: Literal["gloo", "nccl"] = "nccl" if device == "cuda" else "gloo"
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host
        self.store = dist.TCPStore(
            "0.0.0.0",
            0,
            self.world,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self._pg: Any = None
        self._ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self._pending: list[cf.Future[None]] = []

    def describe(self, state: dict[str, Any]) -> CollectiveWeights:
        tensors, buckets = plan_buckets(state, self.bucket_bytes)
        return CollectiveWeights(
            host=self.host,
            port=int(self.store.port),
            world=self.world,
            backend=self.backend,
            timeout_s=self.timeout_s,
            tensors=tensors,
            buckets=buckets,
        )

    def pack(self, state: dict[str, Any], desc: CollectiveWeights) -> list[Any]:
        """The flat buckets of ``state`` (copies: the learner trains on)."""
        return pack(state, desc, self.device)

    def send(self, flats: list[Any]) -> None:
        """Queue one version's broadcast (every worker must receive it, in order)."""
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._ex.submit(self._broadcast, flats))

    def put(self, state: dict[str, Any]) -> CollectiveWeights:
        desc = self.describe(state)
        self.send(self.pack(state, desc))
        return desc

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued broadcast has gone out (raises its error)."""
        for f in self._pending:
            f.result(timeout=timeout_s)

    def _broadcast(self, flats: list[Any]) -> None:
        if self._pg is None:  # the rendezvous waits for every worker's first receive
            self._pg = _group(self.store, 0, self.world, self.backend, self.timeout_s)
        for t in flats:
            self._pg.broadcast(t, 0).wait()

    def close(self) -> None:
        for f in self._pending:
            if not f.done():
                f.cancel()
        self._ex.shutdown(wait=False, cancel_futures=True)
        self._pg = None


class CollectiveReceiver:
    """A worker's end (rank ``index + 1``): joins on its first version."""

    def __init__(self, rank: int, device: str):
        self.rank = rank
        self.device = device
        self._pg: Any = None
        self._store: Any = None
        self._joined: tuple[str, int] | None = None  # the sender's rendezvous

    def leave(self) -> None:
        """Forget the group (after a failed broadcast): the next version rejoins."""
        self._pg = self._store = self._joined = None

    def receive(self, desc: CollectiveWeights) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        if self._joined != (desc.host, desc.port):  # a new sender (a healed rank 0)
            self.leave()
        if self._pg is None:
            self._store = dist.TCPStore(
                desc.host,
                desc.port,
                desc.world,
                is_master=False,
                timeout=datetime.timedelta(seconds=desc.timeout_s),
            )
            self._pg = _group(self._store, self.rank, desc.world, desc.backend, desc.timeout_s)
            self._joined = (desc.host, desc.port)
        flats = [torch.empty(n, dtype=_dtype(dt), device=self.device) for dt, n in desc.buckets]
        for t in flats:
            self._pg.broadcast(t, 0).wait()
        return unpack(flats, desc)


__all__ = [
    "BaseWeights",
    "CollectiveReceiver",
    "CollectiveSender",
    "CollectiveWeights",
    "Descriptor",
    "ObjectStoreWeights",
    "PublishedVersion",
    "WeightSync",
    "plan_buckets",
    "state_bytes",
    "state_digest",
]
