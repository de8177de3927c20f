"""What a policy version is on its way to the rollout fleet: the descriptor each path
sends (``ObjectStoreWeights``, ``CollectiveWeights``, ``BaseWeights``), the record
rank 0 publishes (``PublishedVersion``), and the collective path's bucket layout: a
state dict packed per dtype into flat buckets and rebuilt from the descriptor's
metadata, with a digest for bit-identity checks. ``weight_sync.py`` moves them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from ray import ObjectRef

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

    ref: ObjectRef[dict[str, torch.Tensor]]  # owned by the process that put it
    bytes: int


@dataclass(frozen=True)
class BaseWeights:
    """Version 0: the weights of the base HF folder, which each worker loads itself."""

    model_dir: str


@dataclass(frozen=True)
class CollectiveWeights:
    """The descriptor a worker gets instead of the weights on the collective path:
    the sender's listener, the version's frame tag and the bucket layout (no secret)."""

    host: str
    port: int
    world: int
    tag: bytes  # names this version's frame (random per version)
    timeout_s: float
    handshake_timeout_s: float
    tensors: tuple[TensorMeta, ...]
    buckets: tuple[tuple[str, int], ...]  # (dtype, elements) per bucket, in order

    @property
    def bytes(self) -> int:
        return sum(n * torch_dtype(dt).itemsize for dt, n in self.buckets)


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
# A policy's weights by parameter name (an in-process learner hands over its own).
StateDict = dict[str, "torch.Tensor"]
# What a worker is sent as a version's weights: a descriptor, or (from an in-process
# learner, on the object-store path) a copy of the state dict itself.
SentWeights = Descriptor | StateDict
# What a learner gives the fleet for a version: rank 0's record, the base folder, or
# an in-process learner's state dict (the pool puts it first).
PolicyWeights = PublishedVersion | BaseWeights | StateDict


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(int(t.numel()) * t.element_size() for t in state.values())


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name)
    assert isinstance(dt, torch.dtype)
    return dt


def plan_buckets(
    state: dict[str, torch.Tensor], bucket_bytes: int
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


def pack(
    state: dict[str, torch.Tensor], desc: CollectiveWeights, device: str
) -> list[torch.Tensor]:
    """The flat buckets (copies: the learner changes its tensors on the next step)."""
    import torch

    flats = [torch.empty(n, dtype=torch_dtype(dt), device=device) for dt, n in desc.buckets]
    for m in desc.tensors:
        t = state[m.name].detach()
        flats[m.bucket][m.offset : m.offset + t.numel()].copy_(t.reshape(-1))
    return flats


def unpack(flats: list[torch.Tensor], desc: CollectiveWeights) -> dict[str, torch.Tensor]:
    out = {}
    for m in desc.tensors:
        n = 1
        for d in m.shape:
            n *= d
        out[m.name] = flats[m.bucket][m.offset : m.offset + n].view(m.shape)
    return out


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (bit-identity check)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\t{t.dtype}\t{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
