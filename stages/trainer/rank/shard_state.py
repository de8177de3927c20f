"""A rank's local shards of the weights and optimizer state (what a healing group
fetches from a live peer), and the digest that says two replicas are identical."""

from __future__ import annotations

import hashlib
from typing import TypedDict

import torch


class ShardedState(TypedDict):
    """A rank's local shards: the weights by name, the AdamW state by parameter name."""

    model: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else t
    return local


def sharded_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> ShardedState:
    """This rank's local shards of the weights and of the AdamW state, by name."""
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    return {
        "model": {n: _local(t).detach().clone() for n, t in model.state_dict().items()},
        "optim": {
            names[p]: {k: _local(v).detach().clone() for k, v in st.items()}
            for p, st in optim.state.items()
        },
    }


@torch.no_grad()
def load_sharded_state(
    model: torch.nn.Module, optim: torch.optim.Optimizer, state: ShardedState
) -> None:
    """Inverse of ``sharded_state`` (same mesh size, same rank)."""
    for n, t in model.state_dict().items():
        _local(t).copy_(state["model"][n])
    for n, p in model.named_parameters():
        src = state["optim"].get(n)
        if src is None:
            continue
        dst = optim.state[p]
        for k, v in src.items():
            if k in dst and _local(dst[k]).shape == v.shape and k != "step":
                _local(dst[k]).copy_(v)
            elif hasattr(p, "device_mesh") and v.dim() > 0:
                from torch.distributed.tensor import DTensor

                assert isinstance(p, DTensor)  # a parameter with a mesh is FSDP2's
                dst[k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements)
            else:
                dst[k] = v.clone()


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = _local(p).detach().cpu().contiguous()  # FSDP2: this rank's shard
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
