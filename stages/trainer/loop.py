"""The training loop of one rank of one replica group (torchtitan style, torchft inside).

One readable loop: build the model and optimizer, load the newest complete checkpoint
if there is one, then per step: quorum (and heal from a live peer if behind), LR from
the step, forward/backward on the step's data batch, fault-tolerant gradient
allreduce, clip, commit-or-not, spike check, checkpoint when due.

Data is indexed by step, not by "what the loader happened to serve": the batch of
step ``s`` is ``data_index(s, skipped_windows)``. That makes retrying an uncommitted
step, healing from a peer, restoring a checkpoint and skipping a poisoned window all
the same operation (seek the loader), identical on every replica group.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch

from stages.events import CheckpointEvent, Event, LogEvent, PhaseEvent, StepEvent
from stages.presets import load_model_preset
from stages.trainer import ft
from stages.trainer.config import TrainStageConfig

Window = tuple[int, int]


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``min_ratio * base_lr`` (stateless: the
    LR of a step is a function of the step, so healing needs no scheduler state)."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def data_index(step: int, windows: list[Window]) -> int:
    """The data batch a step trains on, given the skipped ``[start, end)`` windows
    (batch indices). A window is only ever added at or after the batch of the step
    it restarts from, so the batches of earlier steps never change."""
    idx = step
    for start, end in sorted(windows):
        if idx >= start:
            idx += end - start
    return idx


# Restores retried when retention sweeps the newest checkpoint during a read.
RESTORE_ATTEMPTS = 3


@dataclass
class WorkerSpec:
    """Everything one rank needs; picklable, passed to the Ray actor."""

    run_id: str
    replica_group: int
    rank: int
    config: TrainStageConfig
    lighthouse_addr: str
    shards: list[str]
    checkpoint_dir: str
    # Rank 0 of a multi-rank group hosts the group's TCPStore; others get it here.
    store_addr: str = "127.0.0.1"
    store_port: int = 0
    # Curriculum phases: token shards by data role (the phase's mix reads these).
    role_shards: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Control:
    """Commands from the driver to the loop, applied at step boundaries."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: bool = False
    # Fresh workers wait for "go" so that every group joins the first quorum together.
    go: threading.Event = field(default_factory=threading.Event)
    # The driver asks every group to pause at its next step boundary (a spike elsewhere).
    pause: bool = False
    # A loss spike paused the loop at this committed step, awaiting a decision.
    paused_at: int | None = None
    command: tuple[Literal["resume", "restore"], dict[str, Any]] | None = None
    # A spare is told which replica group to become.
    activate_group: int | None = None

    def send(self, kind: Literal["resume", "restore", "stop", "pause", "go", "activate"],
             **params: Any) -> None:
        with self.cond:
            if kind == "stop":
                self.stop = True
                self.go.set()
            elif kind == "go":
                self.go.set()
            elif kind == "activate":
                self.activate_group = int(params["group"])
            elif kind == "pause":
                self.pause = True
            else:
                self.command = (kind, params)
            self.cond.notify_all()

    def wait_activation(self) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: self.stop or self.activate_group is not None)
            return None if self.stop else self.activate_group

    def wait_command(self) -> tuple[str, dict[str, Any]]:
        with self.cond:
            self.cond.wait_for(lambda: self.stop or self.command is not None)
            if self.stop:
                return "stop", {}
            assert self.command is not None
            cmd, self.command = self.command, None
            self.pause = False
            return cmd


class _LoopState:
    """The loop's own resumable state: skipped data windows, torchft's batch count."""

    def __init__(self, loop: TrainLoop):
        self.loop = loop
        self.batches_committed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"windows": [list(w) for w in self.loop.windows],
                "batches_committed": self.loop.manager.batches_committed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.windows = [(int(a), int(b)) for a, b in state["windows"]]
        self.batches_committed = int(state["batches_committed"])


class TrainLoop:
    def __init__(self, spec: WorkerSpec, *, emit: Callable[[Event], None],
                 control: Control, status: dict[str, Any]):
        self.spec = spec
        self.cfg = spec.config
        self.emit_fn = emit
        self.control = control
        self.status = status  # shared with the actor: read by the driver's polls
        self.is_reporter = spec.rank == 0  # each group's rank 0 reports events
        self.windows: list[Window] = []
        self.started_at = time.time()
        # The curriculum phase this loop trains: steps [start_step, end_step) only.
        self.phase = spec.config.phase
        self.phase_start = self.phase.start_step if self.phase is not None else 0
        # Whether join() restores the newest checkpoint (the actor decides: replica.py).
        self.checkpoint_needed: Callable[[], bool] = lambda: True

    # --- events ---------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        if self.is_reporter:
            event.stage = "train"
            self.emit_fn(event)

    def log(self, message: str, level: Literal["debug", "info", "warning", "error"] = "info"
            ) -> None:
        self.emit(LogEvent(message=f"rg{self.spec.replica_group}: {message}", level=level))

    # --- state ----------------------------------------------------------------------
    def heal_state(self) -> dict[str, Any]:
        """What a recovering group fetches from a live peer through torchft. With FSDP2
        each rank sends its local shards: rank r of the peer holds rank r's shards."""
        if self.sharded:
            return {"shards": sharded_state(self.model, self.inner_optimizer),
                    "loop": self.loop_state.state_dict()}
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "loop": self.loop_state.state_dict()}

    def load_heal_state(self, state: dict[str, Any]) -> None:
        # A heal overwrites the weights in place; an async save still copying them
        # must finish first (the optimizer-step guard does not see this write).
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            ckpt.wait_staged()
        if "shards" in state:
            load_sharded_state(self.model, self.inner_optimizer, state["shards"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        self.loop_state.load_state_dict(state["loop"])
        self.healed = True

    def _seek_loader(self, step: int) -> None:
        target = data_index(step - self.phase_start, self.windows)
        if self.loader.batches_served != target:
            seek = getattr(self.loader, "seek", None)
            if seek is not None:
                seek(target)
                return
            st = self.loader.state_dict()
            st["epoch"], st["batch_in_epoch"] = divmod(target, self.loader.batches_per_epoch)
            self.loader.load_state_dict(st)

    # --- setup ----------------------------------------------------------------------
    def build(self) -> None:
        """The group-independent part of start-up (what a spare group does ahead)."""
        from stages.trainer.model import build_model
        from stages.trainer.train_state import set_determinism

        cfg, target = self.cfg, self.cfg.target
        set_determinism(target.seed, deterministic=target.deterministic)
        self.device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
        preset = load_model_preset(cfg.model.preset)
        model: torch.nn.Module = build_model(
            preset, seed=target.seed, checkpoint_path=cfg.model.checkpoint_path)
        if self.phase is not None and self.phase.rope_theta is not None:
            from stages.trainer.model import set_rope_theta

            set_rope_theta(model, self.phase.rope_theta)
        self.model = model.to(self.device)
        self.model.train()
        self.layout = cfg.layout
        self.sharded = cfg.ranks_per_group > 1
        if not self.sharded:  # FSDP2 must wrap the model before the optimizer sees it
            self._parallelize(None)

    def _parallelize(self, mesh: Any) -> None:
        """The plan's layout on this rank (stages.trainer.parallelize), then AdamW over
        what this rank holds."""
        from stages.trainer.parallelize import ParallelModel

        self.parallel = ParallelModel(self.model, self.layout, mesh, self.device)
        self.model = self.parallel.module
        self._make_optimizer()
        self.status.update(layout=self.parallel.built_layout())

    def _make_optimizer(self) -> None:
        target = self.cfg.target
        self.inner_optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=target.learning_rate,
            weight_decay=target.weight_decay, betas=(0.9, 0.95))

    def _shard_in_group(self, store_addr: str, store_port: int) -> Any:
        """Multi-rank group: a gloo/NCCL process group over the group's ranks, the
        plan's (pp, dp_shard, cp, tp) mesh over it with TP/PP/FSDP2 applied, and a
        separate gloo group for DCP's save-thread collectives. Returns that group."""
        import torch.distributed as dist

        from stages.trainer.mesh import build_mesh

        spec, world = self.spec, self.cfg.ranks_per_group
        client = dist.TCPStore(store_addr, store_port, is_master=False,
                               wait_for_workers=False)
        dist.init_process_group(
            "nccl" if self.cfg.device == "cuda" else "gloo",
            store=dist.PrefixStore(f"ito/intra/rg{spec.replica_group}", client),
            rank=spec.rank, world_size=world,
            timeout=timedelta(seconds=self.cfg.fault_tolerance.collective_timeout_s))
        self._parallelize(build_mesh(self.layout, self.device.type))
        return dist.new_group(backend="gloo")

    def warm_up(self) -> None:
        """Pay the one-off costs (autograd kernels, the optimizer's lazy imports) before
        a spare is needed, without touching the model's weights or optimizer state."""
        ids = torch.zeros(1, self.cfg.target.seq_len, dtype=torch.long, device=self.device)
        from stages.trainer.model import causal_lm_loss

        causal_lm_loss(self.model, ids).backward()
        self.model.zero_grad(set_to_none=True)
        p = torch.zeros(1, requires_grad=True, device=self.device)
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p]).step()

    def join(self) -> None:
        """Join replica group ``spec.replica_group``: data shard, torchft Manager,
        checkpoints (and resume from the newest one)."""
        from torchft.optim import OptimizerWrapper

        from stages.checkpointing.checkpointer import Checkpointer
        from stages.trainer.data import TokenLoader
        from stages.trainer.loss_spike import LossSpikeDetector
        from stages.trainer.train_state import TrainState

        spec, cfg, target = self.spec, self.cfg, self.cfg.target
        # Ranks of a group that differ only in pp, cp or tp read the same batch.
        dp = self.layout.dp_shard
        dp_rank = spec.replica_group * dp + self.layout.coords(spec.rank)["dp_shard"]
        dp_world = cfg.replica_groups * dp
        self.loader: Any
        if self.phase is not None:
            from stages.trainer.mix import MixedLoader

            self.loader = MixedLoader(
                {r: [Path(p) for p in ps] for r, ps in spec.role_shards.items()},
                dict(self.phase.data_weights), seq_len=self.phase.seq_len,
                micro_batch=cfg.micro_batch, seed=target.seed + self.phase.index,
                dp_rank=dp_rank, dp_world=dp_world, phase=self.phase.name)
            self.total_steps = self.phase.end_step
        else:
            self.loader = TokenLoader(
                [Path(s) for s in spec.shards], seq_len=target.seq_len,
                micro_batch=cfg.micro_batch, seed=target.seed,
                dp_rank=dp_rank, dp_world=dp_world)
            self.total_steps = target.steps
        self.healed = False

        self.store = None
        store_addr, store_port = spec.store_addr, spec.store_port
        if store_port == 0:
            # Single-rank group: this process hosts the group's store; it dies with it.
            from torch.distributed import TCPStore

            self.store = TCPStore(store_addr, 0, is_master=True, wait_for_workers=False)
            store_port = self.store.port
        ckpt_pg = self._shard_in_group(store_addr, store_port) if self.sharded else None
        inner = self.inner_optimizer
        self.manager = ft.build_manager(
            cfg.fault_tolerance, pg=ft.build_process_group(cfg.fault_tolerance, cfg.device),
            replica_group=spec.replica_group, rank=spec.rank,
            ranks_per_group=cfg.ranks_per_group, store_addr=store_addr,
            store_port=store_port, lighthouse_addr=spec.lighthouse_addr,
            load_state_dict=self.load_heal_state, state_dict=self.heal_state)
        self.optimizer: Any = OptimizerWrapper(self.manager, inner)

        self._last_saved = -1
        self._save_started: dict[int, float] = {}
        self.detector = LossSpikeDetector(cfg.loss_spike)
        self.loop_state: _LoopState = _LoopState(self)
        # The whole resumable state as one DCP Stateful; the loader position in it is
        # informational (the loop seeks by step), the skipped windows are not.
        self.train_state = TrainState(
            self.model, inner, loader=self.loader, rank=spec.rank,
            extras={"loop": self.loop_state, "spike": self.detector})
        # Each group labels its temp folders, so a restarting group never sweeps the
        # in-flight save of the group that is saving now.
        policy = cfg.checkpoint.model_copy(
            update={"storage_uri": f"file://{Path(spec.checkpoint_dir).resolve()}"})
        self.ckpt = Checkpointer(policy, run_label=f"rg{spec.replica_group}",
                                 process_group=ckpt_pg)
        from stages.errors import ItoError

        # Recovery hook (replica.py): a live peer ahead of every checkpoint heals this
        # group through torchft, so no checkpoint is read.
        attempts = RESTORE_ATTEMPTS if self.checkpoint_needed() else 0
        for _ in range(attempts):
            latest = self.ckpt.latest()
            if latest is None:
                break
            try:
                self._restore(latest.step)
            except ItoError:
                # Another group's retention may sweep the newest checkpoint while this
                # (restarting) group reads it: take the then-newest one. A checkpoint
                # that is still there and fails to load is corrupt: that is raised.
                if Path(latest.path).exists():
                    raise
                continue
            self.log(f"resumed from checkpoint step {latest.step}")
            break

    def _restore(self, step: int) -> None:
        records = [r for r in self.ckpt.records() if r.step == step]
        if not records:
            from stages.errors import ErrorCode, ItoError

            raise ItoError(ErrorCode.checkpoint_not_found, f"no complete checkpoint {step}")
        self.ckpt.load(records[0], self.train_state)
        if step <= self.phase_start:
            self.windows = []  # the previous phase's skipped windows index its own data
        self.manager.load_state_dict({"step": self.train_state.step,
                                      "batches_committed": self.loop_state.batches_committed})

    # --- the loop -------------------------------------------------------------------
    def run(self) -> None:
        self.build()
        restarted = bool(self.status.get("restarted"))
        if self.spec.replica_group < 0:
            # A pre-started spare: warm, then wait to take a lost group's place.
            self.warm_up()
            self.status.update(phase="standby")
            group = self.control.wait_activation()
            if group is None:
                return
            self.spec.replica_group = group
            self.is_reporter = self.spec.rank == 0
            self.started_at = time.time()
            restarted = True  # joins a running job: heal, no start barrier
            self.status.update(group=group, restarted=True)
        self.join()
        self.status.update(phase="ready")
        if not restarted:
            self.control.go.wait()
        self.emit(PhaseEvent(phase="startup", start=self.started_at, end=time.time()))
        self.status.update(phase="training")
        recovering_since: float | None = self.started_at if restarted else None
        pace = self.cfg.pace_step_s
        tokens_per_step = self.cfg.micro_batch * self.cfg.target.seq_len
        full = self.cfg.replica_groups

        while not self.control.stop:
            step = self.manager.current_step()
            if step >= self.total_steps:
                break
            if self.control.pause:
                self._pause(step)
                continue
            t0 = time.time()
            self.optimizer.zero_grad()  # torchft: quorum; heals here if we are behind
            if self.healed:
                self.healed = False
                step = self.manager.current_step()
                if step:  # at step 0 it is torchft's initial weight sync, not a recovery
                    self.log(f"healed from a live peer at step {step}")
                if step >= self.total_steps:
                    break
            # After the quorum: a group that just healed jumped to the peers' step.
            if self.phase is not None:
                if step < self.phase_start:  # never train another phase's step here
                    raise RuntimeError(f"step {step} precedes phase {self.phase.name}")
                lr = self.phase.lr(step)
            else:
                lr = lr_at(step, base_lr=self.cfg.target.learning_rate,
                           warmup=self.cfg.target.warmup_steps, total=self.total_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self._seek_loader(step)
            batch_idx = self.loader.batches_served
            input_ids = self.loader.next_batch().to(self.device)
            loss = self._loss(input_ids, batch_idx)  # forward and backward
            ft.allreduce_gradients(self.manager, self.model.parameters())
            global_loss = ft.allreduce_scalar(self.manager, self._group_mean(loss))
            self.parallel.clip_grad_norm_(self.cfg.target.grad_clip)
            self.optimizer.step()  # torchft: should_commit, then the inner step
            committed = self.manager.current_step() > step
            quorum = self.manager.num_participants()
            now = time.time()
            self.emit(StepEvent(step=step + 1 if committed else step,
                                replica_group=self.spec.replica_group,
                                loss=global_loss if math.isfinite(global_loss) else 1e9,
                                tokens=tokens_per_step * quorum * self.layout.dp_shard
                                if committed else 0,
                                seconds=now - t0, committed=committed, quorum_size=quorum,
                                lr=lr, seq_len=int(input_ids.shape[1]),
                                phase=self.phase.name if self.phase is not None else ""))
            self.status.update(step=self.manager.current_step(), quorum=quorum)
            if pace and now - t0 < pace:
                time.sleep(pace - (now - t0))
            if not committed:
                continue
            if recovering_since is not None and quorum == full:
                self.emit(PhaseEvent(phase="recovery", start=recovering_since, end=now))
                recovering_since = None
            # Spike check first: a checkpoint must never capture the spiking update.
            if self._spiked(step + 1, global_loss, batch_idx):
                self._pause(step + 1)
                continue
            self._maybe_checkpoint(step + 1)

        self._finish()

    def _group_mean(self, loss: torch.Tensor) -> torch.Tensor:
        return self.parallel.group_mean_loss(loss)

    def _loss(self, input_ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inj = self.cfg.inject_loss_spike
        # test knob: a poisoned data batch
        scale = inj.scale if inj is not None and batch_idx in inj.batches else 1.0
        return self.parallel.forward_backward(input_ids, scale=scale)

    # --- checkpoints ----------------------------------------------------------------
    def _is_saver(self) -> bool:
        # One group saves: the lowest live replica id is participating rank 0.
        return self.manager.participating_rank() == 0

    def _report_checkpoints(self) -> None:
        for rec in self.ckpt.poll():
            self.emit(CheckpointEvent(step=rec.step, path=rec.path, bytes=rec.bytes,
                                      blocking_s=rec.blocking_s, total_s=rec.total_s,
                                      phase=self.phase.name if self.phase is not None else ""))
            # Blocking includes any wait for the state copy in the next optimizer
            # step, so the badput span is the record's, not save()'s own duration.
            t0 = self._save_started.pop(rec.step, time.time())
            self.emit(PhaseEvent(phase="checkpoint_blocking", start=t0,
                                 end=t0 + rec.blocking_s))

    def _due(self, step: int) -> bool:
        due = self.ckpt.due(step)
        if self.sharded:
            # A time-based policy may differ by a tick between ranks; DCP's save is a
            # collective, so the group saves if any rank says so.
            import torch.distributed as dist

            flag = torch.tensor([int(due)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def _maybe_checkpoint(self, step: int, *, force: bool = False) -> None:
        self._report_checkpoints()
        if not self._is_saver() or not (force or self._due(step)):
            return
        if step == self._last_saved or any(r.step == step for r in self.ckpt.records()):
            return
        self._last_saved = step
        self._save_started[step] = time.time()
        self.train_state.step = step
        self.ckpt.save(step, self.train_state)  # async: blocks only for the state copy

    # --- loss spikes ----------------------------------------------------------------
    def _spiked(self, step: int, loss: float, batch_idx: int) -> bool:
        spike = self.detector.observe(step, loss)
        if spike is None:
            return False
        self.status.update(spike={**spike.model_dump(mode="json"), "batch": batch_idx,
                                  "windows": [list(w) for w in self.windows]})
        return True

    def _pause(self, step: int) -> None:
        """Stop at a committed step until the driver relays the human's decision."""
        self.ckpt.wait()
        self.status.update(paused_at=step, phase="paused")
        self.log(f"paused at step {step}: loss spike, awaiting approval")
        kind, params = self.control.wait_command()
        self.status.update(paused_at=None, spike=None, phase="training")
        if kind == "restore":
            step = int(params["step"])
            self._restore(step)
            # Skip the next ``skip_batches`` batches from the checkpoint's data position.
            start = data_index(step - self.phase_start, self.windows)
            window = (start, start + int(params["skip_batches"]))
            self.windows = sorted({*self.windows, window})
            if self._is_saver_at_end():
                self.ckpt.discard_after(step)  # the abandoned timeline is never resumed
            self.log(f"restored checkpoint step {step}, skipping data batches "
                     f"[{window[0]}, {window[1]})")

    def _finish(self) -> None:
        if not self.control.stop and self._is_saver_at_end():
            self._maybe_checkpoint(self.manager.current_step(), force=True)
        self.ckpt.close()
        self._report_checkpoints()
        self.status.update(phase="finished" if not self.control.stop else "stopped",
                           step=self.manager.current_step(), digest=param_digest(self.model))
        self.manager.shutdown(wait=False)

    def _is_saver_at_end(self) -> bool:
        try:
            return self._is_saver()
        except Exception:
            return False


def _local(t: Any) -> Any:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def sharded_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's local shards of the weights and of the AdamW state, by name."""
    names: dict[Any, str] = {p: n for n, p in model.named_parameters()}
    return {
        "model": {n: _local(t).detach().clone() for n, t in model.state_dict().items()},
        "optim": {names[p]: {k: _local(v).detach().clone() for k, v in st.items()}
                  for p, st in optim.state.items()},
    }


@torch.no_grad()
def load_sharded_state(model: torch.nn.Module, optim: torch.optim.Optimizer,
                       state: dict[str, Any]) -> None:
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

                dp: Any = p
                dst[k] = DTensor.from_local(v.clone(), dp.device_mesh, dp.placements)
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
