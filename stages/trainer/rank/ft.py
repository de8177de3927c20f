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

import math
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from stages.run_facts import PlacementFact
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
    placement: PlacementFact | None,
    sync_quorum: bool = False,
) -> Any:
    """One torchft Manager per rank; rank 0 of the group runs the ManagerServer,
    behind a front (``rank_listeners``), and every rank heals over ``HealTransport``
    (the run's secret proven both ways, ``weights_only`` loads) instead of torchft's
    HTTP transport (every interface, no check, pickles). ``sync_quorum``: the quorum
    is taken before the work that needs it (DiLoCo's syncs), not beside the forward."""
    from torchft.manager import Manager

    from stages.netsec import cluster_address, listener_config
    from stages.trainer.rank.heal_transport import HealTransport
    from stages.trainer.rank.rank_listeners import manager_listeners

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
                # The quorum overlaps the forward pass. A group that must heal trains
                # nothing that step (its gradients are zeroed in the allreduce) and loads
                # the peer's state in should_commit, before the update: every committed
                # step of every group still starts from the same weights.
                # DiLoCo quorums only at its syncs, where a group heals before it sends.
                use_async_quorum=not sync_quorum,
                timeout=timedelta(seconds=cfg.timeout_s),
                # A DiLoCo sync waits for a live group behind (``sync_wait_s``).
                quorum_timeout=timedelta(
                    seconds=cfg.quorum_timeout_s + (cfg.sync_wait_s if sync_quorum else 0.0)
                ),
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
                # Every group builds the same weights from the run's seed (or loads the
                # same checkpoint), so step 0 needs no sync: with it, every group but
                # the first would heal there and train nothing in the run's first step.
                init_sync=False,
                checkpoint_transport=transport,
            )
    except BaseException:
        transport.shutdown(wait=False)
        raise


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 and TP gradients are DTensors: reduce the local shard (same shard on every group).
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class Reduced(NamedTuple):
    """What a step's reduction returns besides the gradients."""

    loss: float  # the participating groups' mean loss
    vote: float  # their mean vote to stop at this step's end (> 0: some group asked)


class GradientReducer:
    """Averages gradients over the participating replica groups in flat buckets of about
    ``bucket_bytes``, each launched as soon as the backward has produced all of it (torch
    DDP's reducer over torchft's fault-tolerant ``manager.allreduce``), so the transfer
    overlaps the rest of the backward instead of following it.

    Buckets hold the parameters in reverse order (the backward's) and are launched in
    index order, the same on every group (gloo and NCCL need one order of collectives).
    The last bucket waits for ``finish`` and carries the loss and the groups' vote to stop
    at this step's end (a resize, ``Reduced.vote``): a step pays no round trip of its own
    for either (gradients are fp32 in every layout the trainer builds, so the loss keeps
    its precision). Buckets are launched during the backward only once ``arm``ed,
    before the last micro-batch's backward (the gradients are then final), and only for
    a group rank whose parameters are plain tensors; under FSDP2, TP or PP the whole
    reduction happens in ``finish``, after the layout's own collectives.

    Never raises on a peer failure: the manager swallows it and the step is not committed
    (``should_commit`` returns False on every group)."""

    def __init__(
        self,
        manager: Any,
        params: Iterable[torch.nn.Parameter],
        *,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.manager = manager
        ordered = [p for p in params if p.requires_grad][::-1]
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in ordered:
            n = _local(p).numel() * p.element_size()
            if not self.buckets or (size and size + n > bucket_bytes):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += n
        self.buckets = self.buckets or [[]]  # the loss alone, then
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list[int] = []
        self._next = 0
        self._armed = False
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in ordered
        ]

    def arm(self) -> None:
        """The next backward produces this step's final gradients: launch each bucket
        as soon as it is complete."""
        self._pending = [len(b) for b in self.buckets]
        self._armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        self._pending[self._bucket_of[id(p)]] -= 1
        # The last bucket is left for finish(), which adds the loss.
        while self._next < len(self.buckets) - 1 and self._pending[self._next] == 0:
            self._launch(self._next, None)
            self._next += 1

    def _launch(self, i: int, loss: torch.Tensor | None, vote: float = 0.0) -> None:
        grads = [_local(p.grad) for p in self.buckets[i] if p.grad is not None]
        parts = [g.reshape(-1) for g in grads]
        if loss is not None:
            dtype = grads[0].dtype if grads else torch.float32
            parts.append(loss.detach().reshape(1).to(dtype=dtype))
            parts.append(torch.full((1,), vote, dtype=dtype, device=loss.device))
        if parts:
            flat = torch.cat(parts)
            self._works.append((self.manager.allreduce(flat), flat, grads))

    @property
    def in_flight(self) -> int:
        """Buckets launched and not yet waited for by ``finish``."""
        return len(self._works)

    def finish(self, loss: torch.Tensor, *, vote: float = 0.0) -> Reduced:
        """Launch what the backward did not, wait for every bucket and write the means
        back into the gradients. Returns the groups' mean loss and mean ``vote`` (1.0:
        this group asks every group to stop at this step's end; any group's ask makes
        the mean positive on every group, so all stop at the same step)."""
        self._armed = False
        last = len(self.buckets) - 1
        for i in range(self._next, last + 1):
            self._launch(i, loss if i == last else None, vote)
        mean_loss = mean_vote = math.nan
        for work, flat, grads in self._works:
            work.wait()
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
            if offset < flat.numel():
                mean_loss, mean_vote = float(flat[offset]), float(flat[offset + 1])
        self._works = []
        self._next = 0
        return Reduced(mean_loss, mean_vote)

    def close(self) -> None:
        """Detach from the parameters (a model handed on to another run gets a new one)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
