"""torchft glue: the lighthouse, one Manager per rank, and a gradient allreduce that
survives a peer's SIGKILL.

Why not ``torchft.ddp.DistributedDataParallel``: on this testbed its comm hook
crashed the *surviving* group when a peer was SIGKILLed mid-allreduce (``assert
fut._fut``: the gloo error is swallowed before the future chain exists, 2 of 2
trials with torchft 0.2.0). We allreduce flat gradient buckets with
``manager.allreduce`` and wait: on a peer failure the manager records the error,
returns completed work, and ``should_commit`` then refuses the step everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch

from stages.run_secret import RunSecret
from stages.trainer.config import FaultToleranceConfig

# Gradients are packed into flat buckets of about this many bytes (one allreduce each).
BUCKET_BYTES = 25 * 1024 * 1024


def build_process_group(cfg: FaultToleranceConfig, device: str) -> Any:
    """The cross-replica-group process group torchft reconfigures on every quorum."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=cfg.collective_timeout_s)
    if device == "cuda":
        return ProcessGroupNCCL(timeout=timeout)
    return ProcessGroupGloo(timeout=timeout)


def build_manager(
    cfg: FaultToleranceConfig,
    *,
    pg: Any,
    replica_group: int,
    rank: int,
    ranks_per_group: int,
    store_addr: str,
    store_port: int,
    lighthouse_addr: str,
    load_state_dict: Callable[[Any], None],
    state_dict: Callable[[], Any],
    secret: RunSecret,
    placement: Any,
) -> Any:
    """One torchft Manager per rank; rank 0 of the group runs the ManagerServer,
    behind a front (``rank_listeners``), and every rank heals over ``HealTransport``
    (the run's secret proven both ways, ``weights_only`` loads) instead of torchft's
    HTTP transport (every interface, no check, pickles)."""
    from torchft.manager import Manager

    from stages.netsec import cluster_address, listener_config
    from stages.trainer.heal_transport import HealTransport
    from stages.trainer.rank_listeners import manager_listeners

    transport = HealTransport(
        secret,
        listener_config(),
        host=cluster_address(),
        timeout=timedelta(seconds=cfg.timeout_s),
        max_connections=cfg.heal_max_connections,
    )
    try:
        with manager_listeners(placement, cfg.front):
            return Manager(
                pg=pg,
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                min_replica_size=cfg.min_replica_groups,
                # Synchronous quorum: a healing group loads the peer's state before its
                # forward pass, so every committed step of every group uses the same weights.
                use_async_quorum=False,
                timeout=timedelta(seconds=cfg.timeout_s),
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
                rank=rank,
                world_size=ranks_per_group,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=lighthouse_addr,
                # The trailing digits give torchft a stable global rank; the lighthouse
                # sorts participants by id, so the lowest live group is participating rank 0.
                replica_id=f"rg{replica_group:03d}",
                heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_interval_ms),
                init_sync=True,
                checkpoint_transport=transport,
            )
    except BaseException:
        transport.shutdown(wait=False)
        raise


def _buckets(params: Iterable[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if size and size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    return [b for b in buckets if b]


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 gradients are DTensors: reduce the local shard (same shard on every group).
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def allreduce_gradients(
    manager: Any, params: Iterable[torch.nn.Parameter], *, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Average gradients over the participating replica groups, one flat bucket at a
    time. Never raises on a peer failure: the manager swallows it and the step is not
    committed (``should_commit`` returns False on every group)."""
    for bucket in _buckets(params, bucket_bytes):
        grads = [_local(g) for g in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def allreduce_scalar(manager: Any, value: torch.Tensor) -> float:
    """Average a scalar (the loss) over the participating groups."""
    t = value.detach().reshape(1).clone().float()
    manager.allreduce(t).wait()
    return float(t.item())
