"""The Ray actor of one trainer rank (the lighthouse's is ``stages.trainer.fleet.lighthouse``).

A plain class wrapped with ``ray.remote`` by the engine, so importing this
module never imports Ray. A trainer actor starts its loop in ``__init__``: when Ray
restarts it after a crash (``max_restarts``), the new process rejoins on its own —
it loads the newest complete checkpoint, and torchft heals it from a live peer if
one is ahead. The driver only pulls events (``poll``) and relays commands. A fleet
handed on to the next engine run (``stages.trainer.fleet.handoff``) starts that run's loop
in the same process (``reassign``).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, TypeVar, TypeVarTuple

from pydantic import JsonValue

from stages.event_buffer import EventBuffer
from stages.run_secret import RunSecret
from stages.trainer.rank.control import CommandName, CommandParams, Control, WorkerSpec
from stages.trainer.rank.idle import run_when_idle
from stages.trainer.rank.rank_state import PeerProgress, RankPoll, RankState, RankStatus

if TYPE_CHECKING:
    import torch
    from ray import ObjectRef
    from torch._C._distributed_c10d import TCPStore

    from stages.events import Event
    from stages.trainer.phase_eval import PhaseEvalRequest
    from stages.trainer.rank.loop import TrainLoop
    from stages.trainer.rank.rank_listeners import GroupStore

# Events buffered in an actor between two polls; beyond this they are aggregated.
MAX_BUFFERED_EVENTS = 10_000

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")

# This process's training loops still in memory: one, whatever runs were handed on.
_LOOPS: weakref.WeakSet[TrainLoop] = weakref.WeakSet()


class RankIdentity(TypedDict):
    """Which run, group and rank a trainer process is now, and what it holds."""

    run_id: str
    group: int
    rank: int
    pid: int
    process_groups: int
    loops: int


class ParamDigest(TypedDict):
    """A rank's parameter digest and the step it was taken at."""

    digest: str
    step: int


# The concurrency group of work that borrows a rank's device before its run trains
# (``run_borrowed``): one call at a time, beside the default group's (poll, commands).
BORROWED_GROUP = "borrowed"

# Every trainer actor's name: run-<run id>-trainer-...
TRAINER_PREFIX, TRAINER_INFIX = "run-", "-trainer-"


def trainer_prefix(run_id: str) -> str:
    return f"{TRAINER_PREFIX}{run_id}{TRAINER_INFIX}"


def worker_name(run_id: str, group: int, rank: int) -> str:
    return f"{trainer_prefix(run_id)}rg{group}-rank{rank}"


def spare_name(run_id: str, index: int, rank: int = 0) -> str:
    """Rank ``rank`` of standby group ``index`` (as many ranks as a replica group)."""
    return f"{trainer_prefix(run_id)}spare{index}-rank{rank}"


def group_cores(group: int, groups: int, cores: list[int]) -> list[int]:
    """Replica group ``group``'s own share of ``cores`` (groups beyond the core count
    share, round robin)."""
    per = max(1, len(cores) // groups)
    start = (group * per) % len(cores)
    return cores[start : start + per]


def _import_rank_modules() -> None:
    """The modules a rank's loop runs on (torch, the loop and its set-up): imported
    ahead, so the calls that need them find them loaded."""
    import torch  # noqa: F401

    from stages.trainer.rank import loop, setup  # noqa: F401


class ReplicaWorker:
    """One rank of one replica group: the training loop in a thread, events buffered."""

    def __init__(self, spec: WorkerSpec, secret: RunSecret):
        """``secret``: the run's, from the driver through Ray (an actor argument, so a
        process Ray restarts gets it again); kept out of the spec, which is written
        to the rank's assignment file."""
        import ray

        from stages.trainer.fleet.handoff import current_spec

        spec = current_spec(spec)  # a restart after a hand-off rejoins the newest run
        if spec.replica_group < 0:
            # A standby starts beside live ranks, often on their cores: its imports
            # (about a second of CPU) run at idle priority, as its build does.
            run_when_idle(_import_rank_modules, name="standby-imports")
        import torch

        # Threads follow the actor's CPU share (env vars would need a runtime_env,
        # which rules out Ray's prestarted workers on restart).
        torch.set_num_threads(max(1, round(spec.config.worker_num_cpus)))
        self.spec = spec
        self._secret = secret
        self._lock = threading.Lock()
        self._events = EventBuffer(MAX_BUFFERED_EVENTS)
        with warnings.catch_warnings():  # Ray marks the property deprecated, no successor
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.status: RankStatus
        # A multi-rank group's store for the run (rank 0 hosts it, behind a front:
        # rank_listeners.GroupStore), and the one its process group was made with,
        # once replaced.
        self.store: TCPStore | None = None
        self._group: GroupStore | None = None
        self._pg_group: GroupStore | None = None
        # (checkpoint, plain model) a phase end's units score when this rank's own model
        # cannot serve as it is; dropped when the fleet moves on.
        self._phase_model: tuple[str, torch.nn.Module] | None = None
        self._pin(spec.replica_group)
        from stages.trainer.rank.rank_listeners import gloo_on_cluster_address

        gloo_on_cluster_address()  # before this process makes any process group
        if spec.config.ranks_per_group > 1:
            self._group_store(spec)
        # What exists now is the process's own for its life (torch and the rank's
        # modules: ~0.2M objects): frozen out of every collection, it no longer adds
        # ~0.1-0.4 s to the first hand-over's (below) nor to an automatic full one
        # mid-run. Before the first loop is built, so a hand-over still frees that.
        gc.freeze()
        self._start_loop(restarted=restarted)

    def _start_loop(self, *, restarted: bool) -> None:
        """This rank's loop of ``self.spec``'s run, in its thread."""
        import ray

        from stages.trainer.rank.loop import TrainLoop  # torch: in the rank's process only
        from stages.trainer.rank.setup import RankSetup

        self.control = Control()
        self.status = RankStatus(
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=[str(g) for g in ray.get_gpu_ids()],
            restarted=restarted,
            started_at=time.time(),
        )
        self.loop = TrainLoop(
            self.spec,
            emit=self._emit,
            control=self.control,
            status=self.status,
            secret=self._secret,
            startup=RankSetup,
        )
        _LOOPS.add(self.loop)
        self.loop.checkpoint_needed = self._checkpoint_needed
        self.loop.peer_steps = self._peer_steps
        self._thread = threading.Thread(target=self._main, name="train-loop", daemon=True)
        self._thread.start()

    def reassign(self, spec: WorkerSpec) -> int:
        """Start the next engine run's loop here (a fleet handed on): the previous
        run's loop has finished (its Manager shut down, its checkpoints closed) and is
        let go; the process, its imports, cores and device stay. Returns the pid."""
        from stages.errors import ErrorCode, ItoError

        self._thread.join(timeout=spec.config.fault_tolerance.actor_ready_timeout_s)
        if self._thread.is_alive():
            raise ItoError(ErrorCode.invalid_state, "the rank's previous loop has not finished")
        if spec.config.ranks_per_group > 1:
            # torchft's Manager keeps its keys (its address, each quorum's rendezvous) in
            # the group's store: every run gets a fresh one from rank 0 (the engine
            # reassigns every rank 0 first). The group's process group stays on the
            # store it was made with, which rank 0 keeps for the process's life.
            if spec.rank == 0:
                if self._pg_group is None:
                    self._pg_group = self._group
                elif self._group is not None:
                    self._group.close()  # the previous run's, not the process group's
            self._group_store(spec)
        with self._lock:
            self._events.drain()  # the previous run's engine polled what it wanted
        self.spec = spec
        self.loop.setup.close()  # a single-rank group's store front: the next run's own
        # The old model and optimizer go before the next run builds its own: one copy
        # on the device at a time (a hand-over keeps the device: same shape).
        del self.loop
        # The loop holds reference cycles (its control, setup and Manager point back at
        # it): only a collection frees its model. What survives one is the process's
        # own (imports, the worker, a kept mesh), and is frozen out of later ones: the
        # rank's imports (torch, transformers, lm-eval: ~0.5M objects) made every full
        # collection take 0.25 s and more, at each hand-over.
        gc.collect()
        gc.freeze()
        self._free_device_memory()
        self._start_loop(restarted=False)
        return os.getpid()

    def _free_device_memory(self) -> None:
        """On CUDA, collect what was let go and hand the cached blocks back, so the next
        model built here (a run's, a probe proxy's) has the device to itself. Host
        memory is left to Python's own collections: a full one costs ~0.25 s here with
        the rank's imports loaded, on the probe's path after each proxy."""
        if self.spec.config.device == "cuda":
            import torch

            gc.collect()
            torch.cuda.empty_cache()

    def _group_store(self, spec: WorkerSpec) -> None:
        """Multi-rank group: rank 0 hosts the group's TCPStore (it dies with rank 0, so
        every incarnation of the group gets a fresh one); the other ranks ask rank 0.
        If rank 0 is restarting, Ray holds the call until it is back."""
        import ray

        from stages.trainer.rank.rank_listeners import host_group_store

        if spec.rank == 0:
            self._group = host_group_store(spec.placement, spec.config.fault_tolerance.front)
            self.store = self._group.store
            spec.store_addr, spec.store_port = self._group.address
            return
        # A standby's rank 0 is its standby group's (Ray restarts a standby that took a
        # group's place as the standby it was created as).
        rank0 = ray.get_actor(
            worker_name(spec.names_id, spec.replica_group, 0)
            if spec.standby_index is None
            else spare_name(spec.names_id, spec.standby_index, 0)
        )
        ref: ObjectRef[tuple[str, int]] = rank0.store_address.remote()
        addr, port = ray.get(ref, timeout=spec.config.fault_tolerance.actor_ready_timeout_s)
        spec.store_addr, spec.store_port = str(addr), int(port)

    def store_address(self) -> tuple[str, int]:
        return self.spec.store_addr, self.spec.store_port

    # --- heal, don't reload -------------------------------------------------------
    def _checkpoint_needed(self) -> bool:
        """Whether this rank's join must read the newest checkpoint: at a fresh start,
        or when no live peer group is ahead of it. A restarted (or activated standby)
        group with such a peer heals from it through torchft and reads nothing. The
        ranks of a multi-rank group follow rank 0's answer (a sharded load is a
        collective: they must all read or none)."""
        restarted = self.status.report().restarted
        # A group a resize adds (launched, or a standby promoted to it) joins live
        # groups, which may be held rather than training: it never reads.
        joining = self.spec.joining or self.control.activate_joining
        if not restarted or joining:
            return not joining
        key = "ito/recovery/checkpoint_needed"
        spec = self.spec
        if spec.config.ranks_per_group > 1 and spec.rank != 0:
            from datetime import timedelta

            from torch._C._distributed_c10d import TCPStore  # where torch defines it

            timeout = timedelta(seconds=spec.config.fault_tolerance.actor_ready_timeout_s)
            client = TCPStore(spec.store_addr, spec.store_port, is_master=False, timeout=timeout)
            return client.get(key) == b"1"
        needed = not self._peer_ahead_of_checkpoints()
        if self.store is not None:
            self.store.set(key, "1" if needed else "0")
        if not needed:
            self.loop.log(
                "a live peer is ahead of every checkpoint: healing from it, no checkpoint read"
            )
        return needed

    def _peer_ahead_of_checkpoints(self) -> bool:
        """Some other replica group's rank 0 is training at or beyond the newest
        complete checkpoint's step (a peer that itself restarted from nothing is not)."""
        from stages.checkpointing.storage import list_checkpoints

        records = list_checkpoints(self.spec.checkpoint_dir)
        newest = records[-1].step if records else 0
        return bool(self._training_peers(enough=lambda p: p.step >= newest))

    def _peer_steps(self) -> list[int]:
        """The steps of the other groups' rank 0 in training (a DiLoCo join's wait)."""
        return [p.step for p in self._training_peers()]

    def _training_peers(
        self, *, enough: Callable[[PeerProgress], bool] | None = None
    ) -> list[PeerProgress]:
        """The other replica groups' rank 0 of this run in training, of those that answer
        within ``peer_probe_timeout_s`` (a restarting peer never does). With ``enough``:
        the first one it holds for, as soon as it answers (else none)."""
        import ray

        me = self.loop.spec.replica_group
        mine = ray.get_runtime_context().get_actor_name()
        pending: list[ObjectRef[PeerProgress]] = []
        for name in ray.util.list_named_actors():
            if (
                isinstance(name, str)
                and name != mine
                and name.startswith(trainer_prefix(self.spec.names_id))
            ):
                try:
                    pending.append(ray.get_actor(name).progress.remote())
                except ValueError:  # gone since the listing
                    continue
        found: list[PeerProgress] = []
        deadline = time.time() + self.spec.config.fault_tolerance.peer_probe_timeout_s
        while pending and (left := deadline - time.time()) > 0:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                try:
                    p = ray.get(ref, timeout=0)
                except Exception:  # a dead or restarting peer is no heal source
                    continue
                if (
                    p.run_id == self.spec.run_id  # not a peer still in an earlier run
                    and p.group >= 0
                    and p.group != me
                    and p.rank == 0
                    and p.state is RankState.training
                ):
                    if enough is not None and enough(p):
                        return [p]
                    found.append(p)
        return [] if enough is not None else found

    def progress(self) -> PeerProgress:
        """Which run, group and rank this is, its state and committed step."""
        report = self.status.report()
        return PeerProgress(
            run_id=self.spec.run_id,
            group=self.loop.spec.replica_group,
            rank=self.spec.rank,
            state=report.state,
            step=report.step,
        )

    def _emit(self, event: Event) -> None:
        with self._lock:
            self._events.append(event.model_dump(mode="json"))

    def _main(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # reported to the driver, which fails the run
            self.status.enter(
                RankState.error,
                error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc()[-4000:],
            )

    # --- driver API -----------------------------------------------------------------
    def poll(self) -> RankPoll:
        """Drain buffered events and report status (the driver pulls; never pushes)."""
        with self._lock:
            events = self._events.drain()
        return RankPoll(events=events, report=self.status.report())

    def pid(self) -> int:
        return os.getpid()

    def identity(self) -> RankIdentity:
        """Which run, group and rank this process is now (a spare changes group once, a
        fleet handed on changes run), and the process groups and training loops it holds
        (a fleet handed on keeps its group's, never piles up new ones, and lets each
        run's loop go with its model)."""
        from stages.trainer.rank.setup import process_groups

        return {
            "run_id": self.spec.run_id,
            "group": self.loop.spec.replica_group,
            "rank": self.spec.rank,
            "pid": os.getpid(),
            "process_groups": process_groups(),
            "loops": len(_LOOPS),
        }

    def command(self, kind: CommandName, params: CommandParams | None = None) -> None:
        if kind in ("next_phase", "stop"):
            self._phase_model = None
        if kind == "activate":  # a standby becomes a group: its cores from now on
            self._pin(int((params or {})["group"]))
            gpus = (params or {}).get("gpu_ids")
            if gpus and self.spec.config.device == "cuda":
                # The freed device of the rank it replaces, as cuda:0 (the standby
                # never initialised CUDA: it warmed up on the CPU).
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        self.control.send(kind, **(params or {}))

    def evaluate_phase(self, request: dict[str, JsonValue]) -> dict[str, JsonValue]:
        """The phase's battery, assembled from its units' results, and HF export on this
        rank, while its loop waits at the phase's end (stages.trainer.phase_eval)."""
        from stages.trainer.phase_eval import evaluate_on_rank

        req = self._at_phase_end(request)
        reply = evaluate_on_rank(
            req,
            cfg=self.loop.cfg,
            model=lambda: self._scored_model(req),
            live=self._live_model() is not None,
        )
        return reply.model_dump(mode="json")

    def export_share(self, request: dict[str, JsonValue], part: int, parts: int) -> dict[str, str]:
        """This rank's share of the phase's HF export shards, while its loop waits at
        the phase's end (stages.trainer.phase_eval)."""
        from stages.trainer.phase_eval import export_share

        req = self._at_phase_end(request)
        writer = f"rg{self.loop.spec.replica_group}/rank{self.spec.rank}"
        return export_share(req, self.loop.cfg, part=part, parts=parts, writer=writer)

    def eval_unit(
        self, request: dict[str, JsonValue], unit: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """One unit of the phase's battery (an lm-eval task or a held-out share), while
        its loop waits at the phase's end (stages.trainer.phase_eval)."""
        from stages.trainer.phase_eval import EvalUnit, run_unit

        req = self._at_phase_end(request)
        reply = run_unit(req, EvalUnit.model_validate(unit), model=lambda: self._scored_model(req))
        return reply.model_dump(mode="json")

    def _scored_model(self, req: PhaseEvalRequest) -> torch.nn.Module:
        """What a phase end's checks score: this rank's own model when it can serve as
        it is, else the closing checkpoint in a plain model, loaded once a phase end."""
        from stages.trainer.phase_eval import closing_checkpoint, load_phase_model

        live = self._live_model()
        if live is not None:
            return live
        if self._phase_model is None or self._phase_model[0] != req.checkpoint:
            self._phase_model = None  # the previous one goes before the next is built
            model = load_phase_model(self.loop.cfg, req.phase, closing_checkpoint(req))
            self._phase_model = (req.checkpoint, model)
        return self._phase_model[1]

    def run_borrowed(self, work: Callable[[*_Args], _T], *args: *_Args) -> _T:
        """``work(*args)`` on this rank's device while its loop warms up and waits for
        the run's data (a stage before training borrows the booked devices: a ladder
        probe's proxies); its caller names the work (a module-level function, which Ray
        sends by reference), so the engine knows nothing of it. What the work held on
        the device is let go before the call returns."""
        try:
            return work(*args)
        finally:
            self._free_device_memory()

    def _at_phase_end(self, request: dict[str, JsonValue]) -> PhaseEvalRequest:
        from stages.errors import ErrorCode, ItoError
        from stages.trainer.phase_eval import PhaseEvalRequest

        req = PhaseEvalRequest.model_validate(request)
        if self.status.report().boundary != req.phase.index:
            raise ItoError(
                ErrorCode.invalid_state, f"rank is not waiting at the end of phase {req.phase.name}"
            )
        if self.loop.phase_end_imports is not None:
            self.loop.phase_end_imports.join()  # its imports and ours would race
        return req

    def _live_model(self) -> torch.nn.Module | None:
        """This rank's model when it can serve an evaluation as it is (one whole, plain
        model), else None (phase_eval loads the closing checkpoint)."""
        loop = self.loop
        if (
            loop.sharded
            or loop.cfg.layout.activation_checkpointing != "none"
            or loop.parallel.fp8_linears
        ):
            return None
        return loop.model

    def _pin(self, group: int) -> None:
        cfg = self.spec.config
        if cfg.device != "cpu" or not cfg.pin_group_cores or group < 0:
            return
        cores = group_cores(group, cfg.replica_groups, sorted(os.sched_getaffinity(0)))
        # Ranks of a group that would share one core stall each other at every
        # collective inside the group: those groups are left unpinned.
        if len(cores) >= cfg.ranks_per_group:
            os.sched_setaffinity(0, cores)

    def cores(self) -> list[int]:
        """The cores this process may run on."""
        return sorted(os.sched_getaffinity(0))

    def param_digest(self) -> ParamDigest:
        """sha256 over every parameter's bytes, with the step it was taken at."""
        from stages.trainer.rank.shard_state import param_digest

        return {"digest": param_digest(self.loop.model), "step": self.loop.current_step()}
