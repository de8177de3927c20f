"""A rank's start-up, in the order it must happen: build the model (the part a spare
does ahead), lay it out over the group's mesh, make the optimizer, then join the
replica group (torchft Manager, checkpoints, resume from the newest one)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stages.presets import load_model_preset
from stages.trainer.rank import ft
from stages.trainer.rank.idle import idle_thread, run_when_idle
from stages.trainer.rank.rank_state import RankState

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from stages.trainer.parallel.layout import ParallelLayout
    from stages.trainer.rank.loop import TrainLoop
    from stages.trainer.rank.rank_listeners import GroupStore


# The mesh and DCP group this process built over its replica group's process group,
# with the (mesh shape, device type) they were built for. A rank handed on to the next
# engine run (stages.trainer.fleet.handoff) reuses them when the shape is the same and
# destroys them when it differs: every process group holds communicators (on NCCL,
# buffers on the device), so a new set per run would pile up over a run's objectives.
@dataclass(frozen=True)
class _GroupMesh:
    key: tuple[tuple[int, ...], str]  # (mesh shape, device type)
    mesh: DeviceMesh
    ckpt_pg: ProcessGroup | None


_GROUP_MESH: list[_GroupMesh] = []  # the one this process built, if any


def _mesh_groups(mesh: DeviceMesh) -> list[ProcessGroup]:
    from stages.trainer.parallel.mesh import FSDP_DIM

    return [mesh[name].get_group() for name in [*(mesh.mesh_dim_names or ()), FSDP_DIM]]


def process_groups() -> int:
    """How many process groups this process holds (the default one included)."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


def group_mesh(layout: ParallelLayout, device_type: str) -> tuple[DeviceMesh, ProcessGroup | None]:
    """This process's (mesh, DCP gloo group) for ``layout``: the ones built for its
    shape before, else new ones (those of another shape destroyed first)."""
    import torch.distributed as dist

    from stages.trainer.parallel.layout import MESH_DIMS
    from stages.trainer.parallel.mesh import build_mesh

    key = (tuple(layout.degrees()[name] for name in MESH_DIMS), device_type)
    if _GROUP_MESH and _GROUP_MESH[0].key == key:
        return _GROUP_MESH[0].mesh, _GROUP_MESH[0].ckpt_pg
    if _GROUP_MESH:
        old = [*_mesh_groups(_GROUP_MESH[0].mesh), _GROUP_MESH[0].ckpt_pg]
        for group in {id(g): g for g in old}.values():  # a size-1 dim may share a group
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        _GROUP_MESH.clear()
    mesh = build_mesh(layout, device_type)
    ckpt_pg = dist.new_group(backend="gloo")  # DCP's save-thread collectives
    _GROUP_MESH.append(_GroupMesh(key, mesh, ckpt_pg))
    return mesh, ckpt_pg


class RankSetup:
    def __init__(self, loop: TrainLoop):
        self.loop = loop
        self.device = torch.device("cpu")
        # A single-rank group's store, which this rank hosts (rank_listeners.GroupStore).
        self.group_store: GroupStore | None = None

    def close(self) -> None:
        """Close the front of the store this rank hosted (a rank handed on to the next
        run hosts a new one; its torchft Manager has shut down its own listeners)."""
        if self.group_store is not None:
            self.group_store.close()
            self.group_store = None

    def build(self) -> None:
        """The group-independent part of start-up (what a spare group does ahead)."""
        from stages.model.lm import build_model
        from stages.trainer.rank.train_state import set_determinism

        loop, cfg = self.loop, self.loop.cfg
        set_determinism(cfg.target.seed, deterministic=cfg.target.deterministic)
        # A standby holds no device: it builds and warms up on the CPU, and binds the
        # device of the rank whose place it takes when it is activated.
        standby = loop.spec.replica_group < 0
        on_cuda = cfg.device == "cuda" and not standby
        self.device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
        model: torch.nn.Module = build_model(
            load_model_preset(cfg.model.preset),
            seed=cfg.target.seed,
            checkpoint_path=cfg.model.checkpoint_path,
        )
        loop.model = model.to(self.device)
        loop.model.train()
        # FSDP2 must wrap the model before the optimizer sees it; a standby for cuda
        # lays it out once it is on its device.
        if not loop.sharded and not (standby and cfg.device == "cuda"):
            self._parallelize(None)

    def _parallelize(self, mesh: DeviceMesh | None) -> None:
        """The plan's layout on this rank (stages.trainer.parallel.parallelize), then AdamW over
        what this rank holds."""
        from stages.trainer.parallel.parallelize import ParallelModel

        loop, target = self.loop, self.loop.cfg.target
        loop.parallel = ParallelModel(
            loop.model,
            loop.cfg.layout,
            mesh,
            self.device,
            # The plan's share (a resize re-cuts it; only pretraining's lm resizes).
            planned_micro_batch_at=(
                loop.cfg.micro_batch_at if loop.cfg.objective.kind == "lm" else None
            ),
        )
        loop.model = loop.parallel.module
        loop.inner_optimizer = torch.optim.AdamW(
            loop.model.parameters(),
            lr=target.learning_rate,
            weight_decay=target.weight_decay,
            betas=target.adam_betas,
        )
        loop.status.update(layout=loop.parallel.built_layout())

    def _shard_in_group(self, store_addr: str, store_port: int) -> ProcessGroup | None:
        """Multi-rank group: a gloo/NCCL process group over the group's ranks, the
        plan's (pp, dp_shard, cp, tp) mesh over it with TP/PP/FSDP2 applied, and a
        separate gloo group for DCP's save-thread collectives (both kept for the
        process's next run, ``group_mesh``). Returns that group."""
        import torch.distributed as dist

        spec, cfg = self.loop.spec, self.loop.cfg
        if dist.is_initialized():
            # A rank handed on from the fleet's previous run (stages.trainer.fleet.handoff):
            # the same processes in the same ranks, so their process group goes on.
            if (dist.get_rank(), dist.get_world_size()) != (spec.rank, cfg.ranks_per_group):
                from stages.errors import ErrorCode, ItoError

                raise ItoError(
                    ErrorCode.invalid_state,
                    f"rank {dist.get_rank()} of {dist.get_world_size()} in this process's "
                    f"group, not rank {spec.rank} of {cfg.ranks_per_group}",
                )
        else:
            # Where torch defines them: ``torch.distributed`` does not re-export them.
            from torch._C._distributed_c10d import TCPStore
            from torch.distributed.distributed_c10d import PrefixStore

            client = TCPStore(store_addr, store_port, is_master=False, wait_for_workers=False)
            dist.init_process_group(
                "nccl" if cfg.device == "cuda" else "gloo",
                store=PrefixStore(f"ito/intra/rg{spec.replica_group}", client),
                rank=spec.rank,
                world_size=cfg.ranks_per_group,
                timeout=timedelta(seconds=cfg.fault_tolerance.collective_timeout_s),
            )
        mesh, ckpt_pg = group_mesh(cfg.layout, self.device.type)
        self._parallelize(mesh)
        return ckpt_pg

    def warm_up(self) -> None:
        """Pay the one-off costs (autograd kernels, the optimizer's lazy imports) before
        a spare is needed, without touching the model's weights or optimizer state."""
        from stages.model.lm import causal_lm_loss

        loop = self.loop
        ids = torch.zeros(1, loop.schedule.phases[0].seq_len, dtype=torch.long, device=self.device)
        causal_lm_loss(loop.model, ids).backward()  # type: ignore[no-untyped-call]  # torch
        loop.model.zero_grad(set_to_none=True)
        p = torch.zeros(1, requires_grad=True, device=self.device)
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p]).step()

    def prepare_standby(self) -> None:
        """A standby's build and warm-up, at idle priority (``stages.trainer.rank.idle``): it
        is started beside live ranks, often on their cores, and must not slow them."""

        def prepare() -> None:
            self.build()
            self.warm_up()

        run_when_idle(prepare, name="standby-warm-up")

    def wait_as_spare(self) -> bool:
        """A pre-started spare (built and warmed up: ``prepare_standby``): wait to take a
        lost group's place, on the lost rank's device. False: the run stopped first."""
        loop = self.loop
        loop.status.enter(RankState.standby)
        group = loop.control.wait_activation()
        if group is None:
            return False
        if loop.cfg.device == "cuda":
            # The actor set CUDA_VISIBLE_DEVICES to the freed device before this
            # process ever touched CUDA (ReplicaWorker.command): it is cuda:0.
            self.device = torch.device("cuda", 0)
            loop.model = loop.model.to(self.device)
            if not loop.sharded:
                self._parallelize(None)
        loop.spec.replica_group = group
        loop.is_reporter = loop.spec.rank == 0
        loop.started_at = time.time()
        loop.status.update(group=group, restarted=True)
        return True

    def join(self) -> bool:
        """Join replica group ``spec.replica_group``: process groups, torchft Manager,
        checkpoints; then wait for the run's data (the fleet is started while data
        prep runs), enter the first phase and resume from the newest checkpoint, in
        its phase. False: the run stopped before its data was ready."""
        from stages.checkpointing.checkpointer import Checkpointer
        from stages.checkpointing.seal import CheckpointBinding
        from stages.trainer.fleet.lighthouse import lighthouse_address
        from stages.trainer.rank.diloco import DiLoCoSync
        from stages.trainer.rank.every_step import EveryStepSync
        from stages.trainer.rank.loss_spike import LossSpikeDetector
        from stages.trainer.rank.saving import RankSaver
        from stages.trainer.rank.train_state import TrainState

        loop, spec, cfg = self.loop, self.loop.spec, self.loop.cfg
        # The first phase's RoPE base on the plain model, before any layout wraps it.
        loop.set_rope_base(loop.schedule.phases[0])
        store_addr, store_port = spec.store_addr, spec.store_port
        if store_port == 0:
            # Single-rank group: this process hosts the group's store, behind a front
            # (rank_listeners); it dies with it, or is closed when the rank is handed
            # on to the next run (``close``).
            from stages.trainer.rank.rank_listeners import host_group_store

            self.group_store = host_group_store(spec.placement, cfg.fault_tolerance.front)
            store_addr, store_port = self.group_store.address
        ckpt_pg = self._shard_in_group(store_addr, store_port) if loop.sharded else None
        if cfg.objective.builder is not None:
            # Before any restore or heal: DPO's reference is these (base) weights.
            from stages.trainer.rank.objective import named_builder

            build = named_builder(cfg.objective.builder)
            loop.objective = build(cfg, loop.parallel, dp_rank=loop.dp_rank, device=self.device)
        loop.manager = ft.build_manager(  # torchft: this group's Manager
            cfg.fault_tolerance,
            pg=ft.build_process_group(cfg.fault_tolerance, cfg.device),
            replica_group=spec.replica_group,
            rank=spec.rank,
            ranks_per_group=cfg.ranks_per_group,
            store_addr=store_addr,
            store_port=store_port,
            # "": the run's new lighthouse was still starting when this rank was made.
            lighthouse_addr=spec.lighthouse_addr
            or lighthouse_address(spec.run_id, cfg.fault_tolerance.actor_ready_timeout_s),
            load_state_dict=loop.load_heal_state,
            state_dict=loop.heal_state,
            secret=loop.secret,
            placement=spec.placement,
            sync_quorum=not cfg.sync.every_step,
        )
        extras: dict[str, Any] = {}
        if cfg.sync.every_step:
            loop.sync = EveryStepSync(loop.manager, loop.inner_optimizer, loop.model)
        else:
            # torchft: DiLoCo syncs from the inner optimizer's step hook every turn; its
            # outer state is part of the checkpoint.
            loop.sync = diloco = DiLoCoSync(
                loop.manager, loop.model, loop.inner_optimizer, cfg.sync
            )
            extras["diloco"] = diloco.state
        loop.detector = LossSpikeDetector(cfg.loss_spike)
        # The whole resumable state as one DCP Stateful; the loader position in it is
        # informational (the loop seeks by step), the skipped windows are not.
        loop.train_state = TrainState(
            loop.model,
            loop.inner_optimizer,
            loader=loop.loader,
            rank=spec.rank,
            extras={"loop": loop.loop_state, "spike": loop.detector, **extras},
        )
        # Each group labels its temp folders, so a restarting group never sweeps the
        # in-flight save of the group that is saving now.
        policy = cfg.checkpoint.model_copy(
            update={"storage_uri": f"file://{Path(spec.checkpoint_dir).resolve()}"}
        )
        loop.ckpt = Checkpointer(
            policy,
            run_label=f"rg{spec.replica_group}",
            process_group=ckpt_pg,
            binding=CheckpointBinding(run_id=spec.run_id, account=spec.account),
        )
        loop.saver = RankSaver(
            loop.ckpt,
            loop.manager,
            loop.train_state,
            loop.schedule,
            loop.emit,
            sharded=loop.sharded,
        )
        loop.status.enter(RankState.awaiting_data)
        # Every phase ends in an HF export whose shards every live rank writes, and in
        # a battery whose units each group's rank 0 runs: the imports overlap the wait
        # for data and training instead of stalling the first phase switch.
        from stages.trainer.phase_eval import battery_runs_lm_eval, warm_phase_end

        tasks = spec.rank == 0 and any(
            battery_runs_lm_eval(p.eval_battery) for p in loop.schedule.phases
        )
        loop.phase_end_imports = idle_thread(
            lambda: warm_phase_end(cfg, tasks=tasks), name="phase-end-imports"
        )
        shards = loop.control.wait_data()
        if shards is None:
            return False
        loop.role_shards = shards
        loop.enter_phase(loop.schedule.phases[0])
        self._resume()
        return True

    def _resume(self) -> None:
        from stages.errors import ItoError

        loop = self.loop
        # A live peer ahead of every checkpoint heals this group through torchft, so no
        # checkpoint is read (the recovery hook, replica.py).
        attempts = RESTORE_ATTEMPTS if loop.checkpoint_needed() else 0
        for _ in range(attempts):
            latest = loop.checkpointer.latest()
            if latest is None:
                return
            try:
                loop.restore(latest.step)
            except ItoError:
                # Another group's retention may sweep the newest checkpoint while this
                # (restarting) group reads it: take the then-newest one. A checkpoint
                # that is still there and fails to load is corrupt: that is raised.
                if Path(latest.path).exists():
                    raise
                continue
            loop.restored(latest.step)
            self._rejoin_membership(latest.step)
            return

    def _rejoin_membership(self, step: int) -> None:
        """The groups that share the batch after a restore of checkpoint ``step``: those
        the driver names (groups resuming a run paused for capacity), or, at a fresh
        start of the run's groups (a relaunched driver), the run's planned groups, which
        may differ from the checkpoint's members when the run was resized before. A
        restarted group keeps the checkpoint's: its peers are the run's members."""
        loop = self.loop
        if loop.spec.membership_from is not None:
            loop.membership.change(*loop.spec.membership_from)
        elif not loop.status.report().restarted:
            planned = tuple(range(loop.cfg.replica_groups))
            if loop.membership.members_at(step) != planned:
                loop.membership.change(step, planned)


# Restores retried when retention sweeps the newest checkpoint during a read.
RESTORE_ATTEMPTS = 3
