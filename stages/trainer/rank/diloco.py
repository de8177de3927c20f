"""DiLoCo across the replica groups: torchft's ``DiLoCo`` in the rank loop.

With ``sync.mode == "diloco"`` a group trains ``turn_steps`` inner steps on its own
share of each step's batch with no cross-group traffic, then the groups average their
pseudo-gradients (the weights at the last sync minus their own) and an outer Nesterov
SGD step moves the shared weights. torchft's ``DiLoCo`` does the sync from the inner
optimizer's step hook: a synchronous quorum (a group behind its peers heals there and
takes part with the pseudo-gradient of the peer it healed from), the allreduce,
``should_commit`` and the outer step.
One torchft step is one sync, so the run's step is ``manager step x turn_steps + the
inner steps since``. A sync that is not committed resets the weights to the last one
and the loop trains the same steps (the same batches: data is indexed by step) again.

The outer state (each fragment's weights at its last sync and the outer optimizer's
momentum) is part of the DCP checkpoint (``DiLoCoState``, one of the ``TrainState``
extras) and of what a healing group fetches (torchft registers it with the Manager).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from stages.events import StepEvent
from stages.replica_sync import ReplicaSync
from stages.trainer.rank.group_sync import StepHost
from stages.trainer.rank.step_state import StepResult, data_index

# A rank joining a running DiLoCo run asks for the quorum only while its peers are on the
# last inner step of a turn: the lighthouse forms a quorum without a straggler after its
# join timeout, so asking any earlier makes a quorum of the joining group alone.
JOIN_POLL_S = 0.05


class ParamFragment(nn.Module):
    """A contiguous slice of a model's parameters, as the module torchft syncs (the
    parameters are the model's own, registered again under flat names)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def fragments_of(model: nn.Module, count: int) -> list[nn.Module]:
    """``model`` as ``count`` fragments of about equal bytes, in parameter order (the
    embedding with the first layers, the head with the last): streaming DiLoCo's split."""
    if count == 1:
        return [model]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in named)
    parts: list[list[tuple[str, nn.Parameter]]] = [[]]
    done = 0
    for name, p in named:
        if parts[-1] and len(parts) < count and done >= total * len(parts) / count:
            parts.append([])
        parts[-1].append((name, p))
        done += p.numel()
    if len(parts) < count:
        from stages.errors import ErrorCode, ItoError

        raise ItoError(
            ErrorCode.plan_sync_invalid,
            f"the model's {len(named)} parameter tensors do not make {count} fragments",
        )
    return [ParamFragment(part) for part in parts]


class DiLoCoState:
    """The outer state for a checkpoint: each fragment's weights at its last sync and
    the outer optimizer's momentum, keyed by name (a momentum not made yet is saved as
    zeros: Nesterov SGD's first step from a zero buffer is the step it takes without)."""

    def __init__(self, sync: DiLoCoSync):
        self.sync = sync

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, (frag, outer) in enumerate(zip(self.sync.fragments, self.sync.outer, strict=True)):
            original = self.sync.torchft_fragment(i).original_parameters
            momentum = {}
            for name, p in frag.named_parameters():
                buf = outer.state.get(p, {}).get("momentum_buffer")
                momentum[name] = buf.detach().clone() if buf is not None else torch.zeros_like(p)
            params = dict(frag.named_parameters())
            out[f"fragment_{i}"] = {
                "original": {n: _like(t.clone(), params[n]) for n, t in original.items()},
                "momentum": momentum,
            }
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        for i, (frag, outer) in enumerate(zip(self.sync.fragments, self.sync.outer, strict=True)):
            saved = state[f"fragment_{i}"]
            original = self.sync.torchft_fragment(i).original_parameters
            for name, t in saved["original"].items():
                original[name].copy_(t.to_local() if isinstance(t, DTensor) else t)
            for name, p in frag.named_parameters():
                outer.state[p]["momentum_buffer"] = saved["momentum"][name].to(p.device).clone()


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A rank's ``local`` shard as the DTensor ``param`` is (same mesh and placements),
    so DCP saves each rank's shard of it under one key; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


class DiLoCoSync:
    """torchft's ``DiLoCo`` on a rank's model and inner optimizer (its hooks stay on
    the optimizer until ``close``), with the step arithmetic the loop needs."""

    def __init__(
        self,
        manager: Any,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync: ReplicaSync,
    ):
        from torchft.local_sgd import DiLoCo

        self.manager = manager
        self.cfg = sync
        self.inner_optimizer = inner_optimizer
        self.fragments = fragments_of(model, sync.fragments)
        self.device = next(model.parameters()).device
        self.outer = [
            torch.optim.SGD(
                f.parameters(),
                lr=sync.outer_lr,
                momentum=sync.outer_momentum,
                # Nesterov needs momentum: at 0 the outer step is plain averaging.
                nesterov=sync.outer_momentum > 0,
            )
            for f in self.fragments
        ]
        self.diloco = DiLoCo(
            manager,
            self.fragments,
            inner_optimizer,
            self.outer,
            sync_every=sync.sync_every,
            # The weights at the last sync stay on the rank's device (a GPU has the room
            # for one more copy of its shard; the CPU testbed has no other).
            backup_device=self.device,
            pin_memory=False,
        )
        self.diloco.__enter__()  # the hooks on the inner optimizer
        self.state = DiLoCoState(self)
        # torchft's hook drops the sync's vote: each fragment's is recorded here.
        self.voted: bool | None = None
        for frag in self.diloco._fragments:
            frag.perform_sync = self._recorded(frag.perform_sync)
        # The turn's steps, reported once its sync commits (dropped if it does not).
        self.pending: list[StepEvent] = []
        self.quorum = 1  # participants of the last sync

    def _recorded(self, perform_sync: Callable[[], bool]) -> Callable[[], bool]:
        def perform() -> bool:
            self.voted = bool(perform_sync())
            return self.voted

        return perform

    def torchft_fragment(self, i: int) -> Any:
        return self.diloco._fragments[i]

    @property
    def inner_steps(self) -> int:
        """Inner steps taken since the last sync (torchft's count)."""
        return int(self.diloco._local_step)

    def current_step(self) -> int:
        """The run's step: the synced turns' steps and the inner steps since."""
        return int(self.manager.current_step()) * self.cfg.turn_steps + self.inner_steps

    def manager_step(self, step: int) -> int:
        """torchft's step (syncs committed) at run step ``step``, a turn's end."""
        return step // self.cfg.turn_steps

    def join_running_run(
        self, peer_steps: Callable[[], list[int]], stopped: Callable[[], bool]
    ) -> None:
        """A group joining a running run (a restart, a standby taking a lost group's
        place) behind its peers' turn takes part in their next sync without inner steps
        of its own: it asks for the quorum once a peer is on a turn's last inner step,
        heals there (torchft: a group behind the quorum's step loads a peer's state) and
        comes out of the outer step with the peers' weights, at their step. With no
        live peer in a later turn (all groups restarted from one checkpoint) it trains
        its turn: the peers' sync waits for it."""
        turn = self.cfg.turn_steps
        mine = self.current_step() // turn
        while not stopped():
            ahead = [s for s in peer_steps() if s // turn > mine]
            if not ahead:
                return
            if any(s % turn == turn - 1 for s in ahead):
                break
            time.sleep(JOIN_POLL_S)
        else:
            return
        # torchft: the hook of the turn's last inner step runs the sync; no gradient is
        # set, so the inner optimizer's step itself changes nothing.
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.diloco._local_step = turn - 1
        self.voted = None
        self.inner_optimizer.step()
        if self.voted:
            # Every group counts the sync's trainers after it commits: this one is none.
            self.quorum = int(self.manager.num_participants())  # torchft
            self._trainers(trained=False)

    def train_step(self, loop: StepHost, step: int) -> StepResult:
        """One inner step (forward, backward, clip, inner AdamW step) on this group's
        share of step ``step``'s batch; the turn's last one syncs in the optimizer's
        hook. Its steps are reported when that sync commits, each with the tokens of
        the groups that trained the turn (a group that healed at the sync trained none)."""
        t0 = time.time()
        self.inner_optimizer.zero_grad()
        share = loop.cut(step)
        batch = data_index(step - loop.phase.start_step, loop.windows)
        data = loop.next_batch(batch)
        inj = loop.cfg.inject_loss_spike  # test knob: a poisoned data batch
        scale = inj.scale if inj is not None and batch in inj.batches else 1.0
        loss = loop.parallel.forward_backward(data, loop.objective, scale=scale)
        local_loss = float(loop.parallel.group_mean_loss(loss))
        grad_norm = loop.parallel.clip_grad_norm_(loop.cfg.target.grad_clip)
        lr = loop.phase.lr(step)

        def result(at: int, committed: bool) -> StepResult:
            now = time.time()
            return StepResult(
                step=at,
                committed=committed,
                loss=local_loss,
                grad_norm=grad_norm,
                lr=lr,
                batch=batch,
                quorum=self.quorum,
                seconds=now - t0 - data.waited_s,
                ended_at=now,
            )

        if not (math.isfinite(local_loss) and math.isfinite(grad_norm)):
            return result(step, committed=False)  # not taken: the loop's spike handling
        for g in self.inner_optimizer.param_groups:
            g["lr"] = lr
        self.voted = None
        self.inner_optimizer.step()  # torchft: the turn's last inner step syncs here
        done = result(step, committed=False)
        self.pending.append(
            StepEvent(
                step=step + 1,
                replica_group=loop.spec.replica_group,
                loss=local_loss,
                tokens=data.tokens * loop.cfg.layout.dp_shard,  # x the turn's trainers
                seconds=done.seconds,
                committed=True,
                lr=lr,
                seq_len=data.seq_len,
                phase=loop.phase.name,
                batch_share=share,
            )
        )
        if self.voted is None:  # mid-turn
            loop.status.update(step=self.current_step())
            loop.pace(t0, self.quorum, step)
            return done
        return self._turn_ended(loop, done, t0)

    def _turn_ended(self, loop: StepHost, done: StepResult, t0: float) -> StepResult:
        """After a sync: report the turn's steps if it committed, or one refused step
        (the loop then trains the turn again from its first step)."""
        pending, self.pending = self.pending, []
        step = self.current_step()
        if not self.voted:
            loop.after_heal(step)  # a heal at a refused sync still moved it to the peers'
            loop.emit(
                StepEvent(
                    step=step,
                    replica_group=loop.spec.replica_group,
                    loss=done.loss,
                    tokens=0,
                    seconds=done.seconds,
                    committed=False,
                    quorum_size=self.quorum,
                    phase=loop.phase.name,
                )
            )
            loop.status.update(step=step)
            return done
        self.quorum = int(self.manager.num_participants())  # torchft
        healed = loop.after_heal(step - 1)
        trainers = self._trainers(trained=not healed)
        for event in [] if healed else pending:
            event.tokens *= trainers
            event.quorum_size = self.quorum
            loop.emit(event)
        loop.status.update(step=step, quorum=self.quorum)
        loop.pace(t0, self.quorum, step - 1)
        done.step, done.committed, done.quorum = step - 1, True, self.quorum
        return done

    def _trainers(self, *, trained: bool) -> int:
        """How many groups' turns the committed sync averaged: its participants less
        those that healed there (torchft's synchronous quorum counts them, with the
        pseudo-gradient of the peer they healed from)."""
        flag = torch.tensor([1.0 if trained else 0.0], device=self.device)
        work = self.manager.allreduce(flag, reduce_op=ReduceOp.SUM)  # torchft
        work.wait()
        return max(1, round(float(flag.item())))

    @property
    def mid_turn(self) -> bool:
        return self.inner_steps > 0

    @contextmanager
    def loading(self) -> Iterator[None]:
        """DiLoCo's hooks off the inner optimizer: a checkpoint's load initialises the
        optimizer's state with a step of zero gradients, which is no inner step."""
        self.diloco.__exit__(None, None, None)
        try:
            yield
        finally:
            self.diloco.__enter__()

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
