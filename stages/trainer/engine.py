"""The driver side of a training run: make the actors, pull their events, supervise.

``TrainingEngine`` runs inside the stage's caller (a RunDriver actor, or a test's
driver). It creates ``run-<id>-lighthouse`` and one ``run-<id>-trainer-rg<N>-rank<M>``
actor per rank, then loops: poll every actor, forward events to ``emit``, turn actor
deaths and restarts into ``InterruptionEvent``s, relay the loss-spike proposal to a
human and the decision back to every group, and stop when every group finished.
Given a ``Fleet`` (``stages.trainer.handoff``), it takes over the ranks the previous
run left there and, when every rank finished, leaves its own for the next run.

Recovery itself is not driven from here: Ray restarts a dead actor (``max_restarts``)
and the new process heals from a live peer through torchft, or, when no group is
left, loads the newest complete checkpoint. The engine only observes and reports.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from stages.checkpointing.seal import run_binding
from stages.checkpointing.storage import list_checkpoints
from stages.curriculum.schedule import PhaseSpan
from stages.errors import ErrorCode, ItoError
from stages.event_buffer import expand_steps
from stages.events import (
    Event,
    FleetEvent,
    InterruptionEvent,
    LogEvent,
    PhaseEvent,
    StepEvent,
)
from stages.placement import PLACEMENT_FACT, actor_options, bundle_for_rank
from stages.run_secret import RunSecret
from stages.trainer.config import TrainStageConfig
from stages.trainer.control import WorkerSpec
from stages.trainer.engine_state import EngineResult, GroupState
from stages.trainer.handoff import Fleet, kill_actors, write_assignment
from stages.trainer.lighthouse import LighthouseActor, lighthouse_name
from stages.trainer.loss_spike import LossSpike, LossSpikeDetector
from stages.trainer.recovery import failure_time, failure_times
from stages.trainer.replica import BORROWED_GROUP, ReplicaWorker, spare_name, worker_name

_EVENT = TypeAdapter(Event)
# Called when every live group closed a phase; True: the gate passed, go on.
PhaseEndHook = Callable[[PhaseSpan], bool]


def _json_fact(fact: Any) -> dict[str, Any] | None:
    """A run fact as JSON (a rank's spec is written to its assignment file)."""
    if not fact:
        return None
    return fact.model_dump(mode="json") if hasattr(fact, "model_dump") else dict(fact)


class RunCancelled(Exception):
    """``cancel_event`` was set; every actor of the run has been killed."""


class TrainingEngine:
    def __init__(
        self,
        cfg: TrainStageConfig,
        *,
        run_id: str,
        checkpoint_dir: Path,
        role_shards: dict[str, list[str]] | None,
        emit: Callable[[Event], None],
        cancel_event: threading.Event,
        wait_decision: Callable[[str, float], str | None],
        facts: dict[str, Any] | None = None,
        on_phase_end: PhaseEndHook | None = None,
        decided: set[int] | None = None,
        fleet: Fleet | None = None,
        secret: RunSecret | None = None,
    ):
        self.cfg = cfg
        # The run's secret (StageContext.secret), handed to every rank as an actor
        # argument; a fleet handed on keeps the one its ranks were made with.
        self.secret = secret if secret is not None else RunSecret.new()
        self.schedule = cfg.schedule
        # None: the run's data is not ready yet; the fleet starts and warms up anyway,
        # and every rank gets the shards (``supply_data``) when they are.
        self.role_shards = dict(role_shards) if role_shards is not None else None
        self._data_sent: dict[tuple[int, int], int] = {}  # rank -> pid that got the data
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self.ft = cfg.fault_tolerance
        self.run_id = run_id
        # Ranks handed over by the previous run and left to the next; the run id the
        # actors' names carry (the run that made them).
        self.fleet = fleet
        self._names_id = run_id
        self._handing_on = False
        self._standby_took_over = False
        self.checkpoint_dir = checkpoint_dir
        # Phase ends: the gate hook, and the phases whose gate already passed (a
        # group that resumes at such a boundary goes on at once).
        self.on_phase_end: PhaseEndHook = on_phase_end or (lambda phase: True)
        self.passed: set[int] = set(decided or ())
        self.stopped_at_phase: int | None = None
        # (boundary, pid) each rank was last told to leave: a poll in flight may show
        # it again; a restarted process (new pid) at the same boundary is told again.
        self._released: dict[tuple[int, int], tuple[int, int]] = {}
        self._rank_pid: dict[tuple[int, int], int] = {}
        self._rank_boundary: dict[tuple[int, int], int | None] = {}
        # Ranks whose last reply said finished (with their final shard digest), and when
        # every group's rank 0 first did.
        self._finished_ranks: set[tuple[int, int]] = set()
        self._rank_phase: dict[tuple[int, int], str] = {}  # each rank's last reported phase
        self._groups_finished_at: float | None = None
        self.emit_fn = emit
        self.cancel_event = cancel_event
        self.wait_decision = wait_decision
        # Run facts; ``placement`` puts every actor on the booking's nodes.
        self.facts = facts or {}
        self.groups = [GroupState(g) for g in range(cfg.replica_groups)]
        self.actors: dict[tuple[int, int], Any] = {}
        self.lighthouse: Any = None
        self._pending: dict[tuple[int, int], Any] = {}
        # Pre-started spares by actor name, and which of them are warm and waiting.
        self.spares: dict[str, Any] = {}
        self._spare_pending: dict[str, Any] = {}
        # When each rank or spare (by key or name) is next polled: an actor is asked at
        # most once per ``poll_interval_s``, however fast it answers.
        self._poll_due: dict[Any, float] = {}
        # The phase that a rank reporting this many committed steps is closing.
        self._phase_ending_at = {p.end_step: p.index for p in self.schedule.phases}
        self._spares_ready: set[str] = set()
        # Each rank's devices as Ray assigned them (cuda): what a standby binds.
        self._gpu_ids: dict[tuple[int, int], list[str]] = {}
        # Standby group index -> its ranks' actor names, while it is a standby.
        self._standby_groups: dict[int, list[str]] = {}
        self._spares_made = 0
        self._lh_addr = ""
        # step -> tokens of its last committed report: every group's rank 0 reports the
        # quorum's tokens of the same step, and a redone step replaces its first run.
        self.step_tokens: dict[int, int] = {}
        self.final_loss: float | None = None
        self.max_step = 0
        self.interruptions = 0
        self.proposals: list[str] = []
        # group -> first committed smaller-quorum step seen by a survivor (torchft's
        # detection) while that group was not yet known lost.
        self._shrunk_at: float | None = None
        self._all_lost_at: float | None = None
        self._spike_pending: dict[str, Any] | None = None
        self._spike_recovering: tuple[float, str] | None = None
        self._ready: set[tuple[int, int]] = set()
        self._spikes_handled: set[tuple[int, int]] = set()
        self._started = False
        self.layout: dict[str, Any] = {}
        self.rank_digests: dict[str, str] = {}
        # Each rank's process id and last answered poll: when it is lost, when it died.
        self._pids: dict[tuple[int, int], int] = {}
        self._reactivated: set[int] = set()
        self._last_seen: dict[tuple[int, int], float] = {}

    # --- lifecycle --------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        if not event.stage:
            event.stage = "train"
        self.emit_fn(event)

    def start_in_background(self) -> None:
        """Place and start the fleet while the caller goes on (data prep, tokenizing);
        ``run`` waits for it."""
        if self._starting is None:
            if self.fleet is not None:
                self.fleet.placing()
            self._starting = threading.Thread(
                target=self._start_catching, name="fleet-start", daemon=True
            )
            self._starting.start()

    def _start_catching(self) -> None:
        try:
            self.start()
        except BaseException as e:  # re-raised by run() in the caller's thread
            self._start_error = e
        finally:
            if self.fleet is not None:  # the ranks the probe may borrow while they warm
                self.fleet.place_done({} if self._start_error else self.actors)

    def _await_start(self) -> None:
        self.start_in_background()
        assert self._starting is not None
        self._starting.join()
        if self._start_error is not None:
            raise self._start_error

    def supply_data(self, role_shards: dict[str, list[str]]) -> None:
        """The run's token shards: sent to every rank waiting for them (at its next
        poll, and again to a process Ray restarted)."""
        self.role_shards = dict(role_shards)

    def start(self) -> None:
        import ray

        if not ray.is_initialized():
            raise ItoError(ErrorCode.ray_unavailable, "Ray is not initialised in this process")
        t0 = time.time()
        kept = False
        if self._fleet_fits():  # the ranks are told the lighthouse with their new spec
            self._lh_addr, kept = self._start_lighthouse()
        handed = self._take_fleet()
        if not handed:
            # New ranks first, then a new lighthouse, whose address is not waited for:
            # Ray starts a node's worker processes a few at a time, and the ranks'
            # (imports, model build) are the long pole; each rank asks the lighthouse
            # (by the run's name for it) when it joins, after its build.
            for g in range(self.cfg.replica_groups):
                for r in range(self.cfg.ranks_per_group):
                    self.actors[(g, r)] = self._make_worker(worker_name(self._names_id, g, r), g, r)
        if self.fleet is not None:  # the ranks the probe borrows: no lighthouse needed
            self.fleet.place_done(self.actors)
        if self.lighthouse is None:
            self._lh_addr, kept = self._start_lighthouse()
        lh_addr = self._lighthouse_address()
        how = f"{len(self.actors)} trainer actors" + (
            f" handed on from run {self._names_id}" if handed else ""
        )
        self._fleet_changed(
            FleetEvent(
                action="lighthouse_started",
                address=lh_addr,
                actors=[worker_name(self._names_id, g, r) for g, r in self.actors],
            ),
            f"{'kept' if kept else 'started'} lighthouse {lh_addr} and {how} "
            f"in {time.time() - t0:.1f}s",
        )

    def _start_lighthouse(self) -> tuple[str, bool]:
        """The run's torchft lighthouse (its address, "" for a new one still starting:
        ``_lighthouse_address``; and whether it was kept): the fleet's, when the
        previous run left one with this run's settings, else a new actor. A lighthouse
        goes on safely: the previous run's Managers shut down with their loops, and it
        stops counting them at their heartbeat timeout (torchft's quorum waits for
        healthy replicas only), so this run's first quorum waits at most that long."""
        import ray

        fleet = self.fleet
        if fleet is not None and fleet.lighthouse is not None:
            previous, fleet.lighthouse = fleet.lighthouse, None
            if fleet.lighthouse_settings == self.ft:
                try:
                    addr = ray.get(previous.address.remote(), timeout=self.ft.actor_ready_timeout_s)
                    self.lighthouse = previous
                    return str(addr), True
                except Exception as e:  # it died between the runs: a new one
                    self.emit(LogEvent(level="warning", message=f"lighthouse not kept: {e}"))
            kill_actors(previous)
        lh_cls = ray.remote(LighthouseActor)
        self.lighthouse = lh_cls.options(  # type: ignore[attr-defined]
            name=lighthouse_name(self.run_id),
            num_cpus=0.1,
            max_restarts=-1,
            **actor_options(self.facts, bundle_index=0),
        ).remote(self.ft, 1, self.facts.get(PLACEMENT_FACT))  # its front admits these nodes
        return "", False

    def _lighthouse_address(self) -> str:
        """The lighthouse's address, waited for once (at most ``actor_ready_timeout_s``)."""
        import ray

        if not self._lh_addr:
            ref = self.lighthouse.address.remote()
            self._lh_addr = str(ray.get(ref, timeout=self.ft.actor_ready_timeout_s))
        return self._lh_addr

    def _take_fleet(self) -> bool:
        """Start this run on the ranks the fleet holds when it has this run's shape;
        False: there are none (or they cannot serve: their previous loop did not end,
        or the shape differs) and this run makes its own, which it leaves there."""
        import ray

        fleet = self.fleet
        if fleet is None:
            return False
        shape = (self.cfg.replica_groups, self.cfg.ranks_per_group, self.cfg.device)
        if self._fleet_fits():
            assert fleet.secret is not None
            self._lighthouse_address()  # the ranks are told it with their new spec
            self._names_id = fleet.fleet_id
            self.secret = fleet.secret  # Ray restarts its ranks with the one they got
            try:
                # Every group's rank 0 first: it makes the store its group's other ranks
                # then ask it for (ReplicaWorker.reassign).
                for rank0 in (True, False):
                    replies = []
                    for key, actor in fleet.actors.items():
                        if (key[1] == 0) == rank0:
                            spec = self._spec(worker_name(self._names_id, *key), *key)
                            write_assignment(spec)  # first: a restart from here joins this run
                            replies.append(actor.reassign.remote(spec))
                    ray.get(replies, timeout=self.ft.actor_ready_timeout_s)
                self.actors = dict(fleet.actors)
                return True
            except Exception as e:  # a rank died between the runs, or never finished
                self.emit(LogEvent(level="warning", message=f"fleet not handed on: {e}"))
        fleet.kill_ranks()
        fleet.fleet_id, fleet.shape, fleet.secret = self.run_id, shape, self.secret
        self._names_id = self.run_id
        return False

    def _fleet_fits(self) -> bool:
        """Whether the fleet holds ranks of this run's shape to hand on."""
        fleet = self.fleet
        shape = (self.cfg.replica_groups, self.cfg.ranks_per_group, self.cfg.device)
        return (
            fleet is not None
            and bool(fleet.actors)
            and fleet.shape == shape
            and fleet.secret is not None
        )

    @property
    def _fleet_can_carry(self) -> bool:
        """Whether this run's ranks can go on to the next run: not after a standby took a
        group's place (Ray would restart it as the standby it was made as, with that
        standby's assignment file, and a multi-rank group's ranks find their rank 0 by
        the group's name)."""
        return not self._standby_took_over

    def _spec(
        self, name: str, group: int, rank: int, standby_index: int | None = None
    ) -> WorkerSpec:
        return WorkerSpec(
            run_id=self.run_id,
            replica_group=group,
            rank=rank,
            config=self.cfg,
            lighthouse_addr=self._lh_addr,
            checkpoint_dir=str(self.checkpoint_dir),
            standby_index=standby_index,
            fleet_id=self._names_id,
            assignment_path=self.fleet.assignment_path(name) if self.fleet else "",
            account=run_binding(self.run_id, self.facts).account,
            placement=_json_fact(self.facts.get(PLACEMENT_FACT)),
        )

    def _fleet_changed(self, event: FleetEvent, message: str) -> None:
        """The fleet change as structure, and its line for people."""
        self.emit(event)
        self.emit(LogEvent(message=message))

    def _make_worker(
        self, name: str, group: int, rank: int, standby_index: int | None = None
    ) -> Any:
        import ray

        spec = self._spec(name, group, rank, standby_index)
        if spec.assignment_path:
            write_assignment(spec)  # replaces one an earlier driver of the run left
        world = self.cfg.replica_groups * self.cfg.ranks_per_group
        index = (
            bundle_for_rank(self.facts, max(group, 0) * self.cfg.ranks_per_group + rank, world)
            if group >= 0
            else -1
        )
        return (
            # Work that borrows the rank before its run trains (the ladder probe) runs
            # in a concurrency group of its own, beside the driver's calls.
            ray.remote(concurrency_groups={BORROWED_GROUP: 1})(  # type: ignore[call-overload]
                ReplicaWorker
            )
            .options(
                name=name,
                num_cpus=self.cfg.worker_num_cpus,
                **actor_options(self.facts, bundle_index=index),
                # One GPU per rank on cuda: Ray sets CUDA_VISIBLE_DEVICES, so it is cuda:0.
                # A standby holds none: it binds the freed one of the rank it replaces.
                num_gpus=1 if self.cfg.device == "cuda" and group >= 0 else 0,
                # No runtime_env: a restart can then use one of Ray's prestarted idle
                # workers instead of spawning a new Python process.
                max_restarts=self.ft.max_restarts,
                max_task_retries=0,
            )
            .remote(spec, self.secret)
        )

    def _start_spare(self) -> None:
        """Start one standby group: as many standby ranks as a replica group has."""
        index = self._spares_made
        self._spares_made += 1
        names = [spare_name(self._names_id, index, r) for r in range(self.cfg.ranks_per_group)]
        self._standby_groups[index] = names
        for r, name in enumerate(names):
            self.spares[name] = self._make_worker(name, -1, r, standby_index=index)

    def _promote_spare(self, key: tuple[int, int]) -> bool:
        """Put a warm standby group in the place of lost group ``key[0]``: every rank of
        the lost group is replaced (a multi-rank group is one failure unit, so its
        survivors go too), and the standby's ranks form the group's process group
        around their own store. False: no standby group is warm."""
        warm = [i for i, names in self._standby_groups.items() if self._spares_ready >= set(names)]
        if not warm:
            return False
        index = min(warm)
        names = self._standby_groups.pop(index)
        self._standby_took_over = True
        group = key[0]
        for rank, name in enumerate(names):
            self._spares_ready.discard(name)
            self._spare_pending.pop(name, None)
            spare = self.spares.pop(name)
            # The lost group's actors would be restarted by Ray as a second copy of it.
            kill_actors(self.actors[(group, rank)])
            self._pending.pop((group, rank), None)
            # The dead processes' pids must not be found dead again once it recovered.
            self._pids.pop((group, rank), None)
            self.actors[(group, rank)] = spare
            spare.command.remote("activate", self._activation(group, rank))
        self._fleet_changed(
            FleetEvent(action="standby_activated", replica_group=group, actors=names),
            f"spare {', '.join(names)} takes the place of replica group {group}",
        )
        self._start_spare()
        return True

    def _activation(self, group: int, rank: int) -> dict[str, Any]:
        """What a standby is told when it becomes rank ``rank`` of ``group``: the group,
        and on cuda the device of the rank it replaces (the standby holds none)."""
        return {"group": group, "gpu_ids": self._gpu_ids.get((group, rank), [])}

    def shutdown(self) -> None:
        """Kill every actor this engine made or took over (cancel, finish or failure; a
        fleet still being placed is first let finish, so no actor outlives this), but
        leave the ranks to the fleet when every one of them finished this run."""
        if self._starting is not None:
            self._starting.join()

        ending = [] if self._handing_on else [*self.actors.values(), self.lighthouse]
        if self.fleet is not None and self.actors:  # not yet shut down
            self.fleet.actors = dict(self.actors) if self._handing_on else {}
            self.fleet.placed = {}  # the run is over: nothing borrows its ranks now
            if self._handing_on:  # the lighthouse goes on with the ranks
                self.fleet.lighthouse, self.fleet.lighthouse_settings = self.lighthouse, self.ft
        kill_actors(*ending, *self.spares.values())
        self.actors.clear()
        self.spares.clear()
        self.lighthouse = None

    # --- polling ----------------------------------------------------------------------
    def poll_once(self, timeout_s: float) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        started = time.monotonic()
        for key, actor in self.actors.items():
            if key not in self._pending and self._due(key, started):
                self._pending[key] = actor.poll.remote()
        self._poll_spares()
        refs = {ref: key for key, ref in self._pending.items()}
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        else:  # every rank answered its last poll: wait for the next one's turn
            ready = []
            # Only an actor with no poll in flight has a turn coming (one in flight is
            # checked each pass): a standby still warming up, its poll unanswered for
            # seconds, must not turn this into a busy loop beside the ranks.
            idle: list[Any] = [k for k in self.actors if k not in self._pending]
            idle += [n for n in self.spares if n not in self._spare_pending]
            next_due = min(
                (self._poll_due.get(k, started) for k in idle), default=started + timeout_s
            )
            time.sleep(max(0.0, min(timeout_s, next_due - started)))
        now = time.time()
        for ref in ready:
            key = refs[ref]
            if key not in self._pending or self._pending[key] is not ref:
                continue  # a poll of an actor replaced meanwhile (a standby took over)
            del self._pending[key]
            try:
                reply: dict[str, Any] = ray.get(ref, timeout=0)
            except (RayActorError, GetTimeoutError) as e:
                self._on_actor_down(key, now, e)
                continue
            self._on_reply(key, reply, now)
        self._check_stuck(now)

    def _restart_group(self, dead: tuple[int, int]) -> None:
        """A multi-rank group is one failure unit: its other ranks are killed too and
        Ray restarts them all, around a fresh store hosted by the new rank 0."""
        import ray

        for (g, r), actor in self.actors.items():
            if g == dead[0] and r != dead[1]:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=False)

    def _due(self, key: Any, now: float) -> bool:
        """Whether ``key``'s next poll is due (and, if so, when the one after is)."""
        if now < self._poll_due.get(key, 0.0):
            return False
        self._poll_due[key] = now + self.ft.poll_interval_s
        return True

    def _poll_spares(self) -> None:
        import ray

        now = time.monotonic()
        for name, actor in self.spares.items():
            if name not in self._spare_pending and self._due(name, now):
                self._spare_pending[name] = actor.poll.remote()
        refs = {ref: name for name, ref in self._spare_pending.items()}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            name = refs[ref]
            del self._spare_pending[name]
            try:
                status = ray.get(ref, timeout=0)["status"]
            except Exception:  # a dead spare: Ray restarts it, it warms up again
                self._spares_ready.discard(name)
                continue
            if status["phase"] == "standby" and name not in self._spares_ready:
                self._spares_ready.add(name)
                self._fleet_changed(
                    FleetEvent(action="standby_warm", actors=[name]), f"standby {name} is warm"
                )

    def _on_actor_down(self, key: tuple[int, int], now: float, err: Exception) -> None:
        grp = self.groups[key[0]]
        grp.lost_since_poll_fail = grp.lost_since_poll_fail or now
        if grp.lost_at is None:
            # torchft may have noticed first: a survivor committed in a smaller quorum.
            detected = min(now, self._shrunk_at) if self._shrunk_at else now
            grp.lost_at = max(detected, grp.last_ok)
            grp.failed_at = self._failed_at(key, self._pids.get(key), grp.lost_at)
            self.emit(
                LogEvent(
                    level="warning",
                    message=f"replica group {grp.index} lost (rank {key[1]}): {type(err).__name__}",
                )
            )
            if all(g.lost_at is not None and not g.finished for g in self.groups):
                self._all_lost_at = min(g.lost_at or now for g in self.groups)
            if self._promote_spare(key):
                grp.pid = None
                grp.restarts += 1
                grp.lost_since_poll_fail = None
            elif self.cfg.ranks_per_group > 1:
                self._restart_group(key)
            # A survivor rank of the lost group may have reported its failed collective:
            # that error died with the processes being replaced.
            grp.error = None

    def _on_reply(self, key: tuple[int, int], reply: dict[str, Any], now: float) -> None:
        g, rank = key
        grp = self.groups[g]
        status = reply["status"]
        if status["phase"] == "standby" and status["pid"] not in self._reactivated:
            # A standby that had taken this group's place died and Ray restarted it:
            # it came back as a standby; it is this group's rank again.
            self._reactivated.add(status["pid"])
            self.actors[key].command.remote("activate", self._activation(g, rank))
        if status["phase"] == "ready":
            self._ready.add(key)
        if (
            status["phase"] == "awaiting_data"
            and self.role_shards is not None
            and self._data_sent.get(key) != status["pid"]
        ):
            self._data_sent[key] = status["pid"]
            self.actors[key].command.remote("data", {"role_shards": self.role_shards})
        grp.last_ok = now
        grp.lost_since_poll_fail = None
        if grp.pid is not None and status["pid"] != grp.pid and rank == 0:
            grp.restarts += 1
            if grp.lost_at is None:  # restarted between two polls
                grp.lost_at = status["started_at"]
                grp.failed_at = self._failed_at(key, grp.pid, grp.lost_at)
        self._pids[key] = int(status["pid"])
        self._last_seen[key] = now
        if status.get("gpu_ids"):
            self._gpu_ids[key] = list(status["gpu_ids"])
        if rank == 0:
            grp.pid = status["pid"]
            grp.phase = status["phase"]
            grp.step = status["step"]
            grp.finished = status["phase"] == "finished"
            grp.digest = status.get("digest")
            grp.paused = status.get("paused_at") is not None
            if status.get("layout"):
                self.layout = status["layout"]
            grp.boundary = status.get("boundary")
        self._rank_boundary[key] = status.get("boundary")
        closing = self._phase_ending_at.get(status.get("step", -1))
        if (
            status["phase"] == "training"
            and status.get("boundary") is None
            and closing is not None
            and closing not in self.passed
        ):
            # Its closing save is in flight: the boundary (and so the gate) is polled
            # for sooner than the next regular poll.
            every = min(self.ft.poll_interval_s, len(self.actors) / self.ft.phase_end_polls_per_s)
            due = time.monotonic() + every
            self._poll_due[key] = min(self._poll_due.get(key, due), due)
        self._rank_pid[key] = status["pid"]
        self._rank_phase[key] = status["phase"]
        if status["phase"] == "finished":
            self._finished_ranks.add(key)
        else:
            self._finished_ranks.discard(key)
        b = status.get("boundary")
        if b is not None and b in self.passed and self._released.get(key) != (b, status["pid"]):
            # Resumed (or restarted) at a boundary whose gate already passed.
            self._released[key] = (b, status["pid"])
            self.actors[key].command.remote("next_phase", {})
        if status.get("digest"):
            self.rank_digests[f"{g}/{rank}"] = status["digest"]
        if status.get("error"):
            grp.error = status["error"]
        for raw in reply["events"]:
            for one in expand_steps(raw) if raw.get("kind") == "step" else (raw,):
                self._on_event(_EVENT.validate_python(one), grp)
        spike = status.get("spike")
        if spike and status.get("paused_at") is not None and self._spike_pending is None:
            # A poll in flight during the last decision may still show that spike.
            key = (int(spike["step"]), int(spike["batch"]))
            if key not in self._spikes_handled:
                self._spikes_handled.add(key)
                self._spike_pending = {**spike, "group": g, "at": now}

    def _on_event(self, event: Event, grp: GroupState) -> None:
        if isinstance(event, StepEvent) and not event.committed:
            self._find_dead()
        if isinstance(event, StepEvent) and event.committed:
            self.step_tokens[event.step] = event.tokens
            if event.step >= self.max_step:
                self.max_step = event.step
                self.final_loss = event.loss
            full = self.cfg.replica_groups
            if self._all_lost_at is not None and grp.lost_since_poll_fail is None:
                self._recovered(grp, event.ts)
            if event.quorum_size < full and self._shrunk_at is None and grp.lost_at is None:
                self._shrunk_at = event.ts
            if event.quorum_size == full:
                self._shrunk_at = None
                self._recovered(grp, event.ts)
            if self._spike_recovering is not None:
                detected, detail = self._spike_recovering
                self._spike_recovering = None
                self._interruption("loss_spike", None, detected, event.ts, detail)
        self.emit(event)

    def _find_dead(self) -> None:
        """A survivor's collective failed: ask Ray which ranks' processes ended and
        treat them as lost now, without waiting for their polls to fail."""
        live = {pid: key for key, pid in self._pids.items() if self.groups[key[0]].lost_at is None}
        now = time.time()
        for pid in failure_times(list(live)):
            if self.groups[live[pid][0]].lost_at is None:
                self._on_actor_down(live[pid], now, RuntimeError("the process ended (Ray)"))

    def _failed_at(self, key: tuple[int, int], pid: int | None, detected: float) -> float:
        """When rank ``key``'s process ``pid`` died: Ray's record of its end, else the
        last poll it answered (never after its loss was detected)."""
        died = failure_time(pid)
        if died is None:
            died = self._last_seen.get(key, detected)
        return min(died, detected)

    def _recovered(self, grp: GroupState, ts: float) -> None:
        if self._all_lost_at is not None:
            failed = [g.failed_at for g in self.groups if g.failed_at is not None]
            self._interruption(
                "all_groups_lost",
                None,
                self._all_lost_at,
                ts,
                "every replica group was lost; restarted from the newest complete checkpoint",
                failed=min(failed, default=None),
            )
            self._all_lost_at = None
            for g in self.groups:
                g.lost_at = g.failed_at = None
            return
        for g in self.groups:
            if (
                g.lost_at is not None
                and g.pid is not None
                and g.lost_since_poll_fail is None
                and (g is grp or g.phase == "training")
            ):
                self._interruption(
                    "replica_group_lost",
                    g.index,
                    g.lost_at,
                    ts,
                    f"healed from a live peer after {g.restarts} restart(s)",
                    failed=g.failed_at,
                )
                g.lost_at = g.failed_at = None

    def _interruption(
        self,
        kind: Any,
        group: int | None,
        detected: float,
        recovered: float | None,
        detail: str,
        *,
        failed: float | None = None,
    ) -> None:
        self.interruptions += 1
        self.emit(
            InterruptionEvent(
                interruption_kind=kind,
                replica_group=group,
                failed_at=failed,
                detected_at=detected,
                recovered_at=recovered,
                detail=detail,
            )
        )

    def _check_stuck(self, now: float) -> None:
        errors = [g.error for g in self.groups if g.error]
        if errors and all(g.error or g.finished for g in self.groups):
            raise ItoError(ErrorCode.training_failed, f"trainer failed: {errors[0]}")
        down = [
            g
            for g in self.groups
            if g.lost_since_poll_fail is not None
            and now - g.lost_since_poll_fail > self.ft.actor_ready_timeout_s
        ]
        if len(down) == len(self.groups):
            raise ItoError(
                ErrorCode.all_replica_groups_lost,
                f"no replica group came back within {self.ft.actor_ready_timeout_s}s",
            )

    # --- commands ---------------------------------------------------------------------
    def command_all(self, kind: str, params: dict[str, Any] | None = None) -> None:
        import ray

        refs = [a.command.remote(kind, params or {}) for a in self.actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=self.ft.stop_timeout_s)

    def _handle_spike(self) -> None:
        spike = self._spike_pending
        assert spike is not None
        self.command_all("pause")
        # Let every live group reach its pause (a straggler may first wait out the join
        # timeout), so their last steps and saves are reported before the proposal.
        deadline = time.time() + self.ft.join_timeout_ms / 1000 + self.ft.stop_timeout_s
        while (
            time.time() < deadline
            and not self.cancel_event.is_set()
            and not all(g.paused or g.lost_at is not None or g.finished for g in self.groups)
        ):
            self.poll_once(self.ft.poll_interval_s)
        # Restart from before the spike: a checkpoint at the spike step holds its update.
        candidates = [
            r.step for r in list_checkpoints(self.checkpoint_dir) if r.step < spike["step"]
        ]
        if not candidates:
            self.emit(
                LogEvent(
                    level="warning",
                    message=f"loss spike at step {spike['step']} but no checkpoint "
                    "to restart from; continuing",
                )
            )
            self.command_all("resume")
            self._spike_pending = None
            return
        ckpt = candidates[-1]
        detector = LossSpikeDetector(self.cfg.loss_spike)
        fields = {k: v for k, v in spike.items() if k in LossSpike.model_fields}
        for k in ("loss", "z", "median", "mad"):
            if fields.get(k) is None:
                fields[k] = math.nan
        proposal = detector.propose(LossSpike(**fields), ckpt)
        proposal.stage = "train"
        self.proposals.append(proposal.proposal_id)
        self.emit(proposal)
        paused_at = time.time()
        decision = self._await_decision(proposal.proposal_id)
        self.emit(PhaseEvent(phase="idle", start=paused_at, end=time.time()))
        detail = f"loss spike at step {spike['step']}: {decision or 'no decision'}"
        if decision == "approved":
            self.command_all(
                "restore", {"step": ckpt, "skip_batches": proposal.params["skip_batches"]}
            )
            self._spike_recovering = (spike["at"], detail)
        else:
            self.command_all("resume")
        self.emit(LogEvent(message=detail))
        self._spike_pending = None

    def _stop_gracefully(self) -> None:
        """Cancel: every rank stops at its next step boundary and reports what it still
        holds (a checkpoint committed since its last poll: it is on disk, so the run's
        record must list it), for at most ``stop_timeout_s``; then every actor is killed."""
        self.command_all("stop")
        deadline = time.time() + self.ft.stop_timeout_s
        while time.time() < deadline and any(
            self._rank_phase.get(key) not in ("stopped", "finished", "error") for key in self.actors
        ):
            self.poll_once(self.ft.poll_interval_s)

    def _await_decision(self, proposal_id: str) -> str | None:
        waited = 0.0
        limit = self.ft.decision_timeout_s
        while not self.cancel_event.is_set():
            decision = self.wait_decision(proposal_id, self.ft.decision_poll_s)
            if decision is not None:
                return decision
            self.poll_once(0)  # keep draining events while paused
            waited += self.ft.decision_poll_s
            if limit is not None and waited >= limit:
                return None
        return None

    # --- the supervision loop ---------------------------------------------------------
    def run(self) -> EngineResult:
        try:
            self._await_start()
            if self.role_shards is None:
                raise ItoError(ErrorCode.internal_error, "the engine ran before its data")
            while True:
                if self.cancel_event.is_set():
                    self._stop_gracefully()
                    raise RunCancelled()
                self.poll_once(self.ft.poll_interval_s)
                if not self._started and len(self._ready) == len(self.actors):
                    # Every rank built its model: release them into one first quorum.
                    self.command_all("go")
                    self._started = True
                    # Standbys warm up once the fleet trains: their start-up never
                    # takes CPU from the fleet's own on the way to its first step.
                    for _ in range(self.cfg.spare_groups):
                        self._start_spare()
                if self._spike_pending is not None:
                    self._handle_spike()
                    continue
                if self._phase_closed() and self.stopped_at_phase is not None:
                    break
                if self._every_rank_finished():
                    self._handing_on = self.fleet is not None and self._fleet_can_carry
                    break
                if self._stragglers_done():
                    break
            for g in self.groups:
                if g.lost_at is not None:
                    self._interruption(
                        "replica_group_lost",
                        g.index,
                        g.lost_at,
                        None,
                        "not recovered before the run finished",
                        failed=g.failed_at,
                    )
        finally:
            self.shutdown()
        records = list_checkpoints(self.checkpoint_dir)
        return EngineResult(
            steps=self.max_step,
            tokens=sum(self.step_tokens.values()),
            final_loss=self.final_loss,
            interruptions=self.interruptions,
            checkpoints=[r.step for r in records],
            final_checkpoint=records[-1].path if records else None,
            proposals=self.proposals,
            digests={g.index: g.digest for g in self.groups if g.digest},
            layout=self.layout,
            rank_digests=self.rank_digests,
            stopped_at_phase=self.stopped_at_phase,
        )

    def evaluate_on_rank(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """A phase's battery and export on the ranks waiting at its end
        (``phase_eval.evaluate_phase_end``); returns ``PhaseEvalReply``."""
        from stages.trainer.phase_eval import evaluate_phase_end

        live = sorted(g.index for g in self.groups if g.lost_at is None) or [0]
        return evaluate_phase_end(self.actors, live, request, timeout_s)

    def _phase_closed(self) -> bool:
        """Every live rank waits at the same phase end: run its gate, then let every
        rank go on (passed) or stop the run (failed). True when a gate was run."""
        live = [k for k in self.actors if self.groups[k[0]].lost_at is None]
        marks = {self._rank_boundary.get(k) for k in live}
        if not live or len(marks) != 1:
            return False
        b = marks.pop()
        if b is None or b in self.passed:
            return False
        if not self.on_phase_end(self.schedule.phases[b]):
            self.stopped_at_phase = b
            return True
        self.passed.add(b)
        for k in self.actors:
            self._released[k] = (b, self._rank_pid.get(k, 0))
        self.command_all("next_phase")
        return True

    def _every_rank_finished(self) -> bool:
        # Rank 0 speaks for its group's progress, but every other rank's final shard
        # digest comes on its own reply: wait for those too, bounded in case a rank
        # died after its last step.
        if not all(g.finished for g in self.groups):
            return False
        now = time.time()
        if self._groups_finished_at is None:
            self._groups_finished_at = now
        return (
            self._finished_ranks >= set(self.actors)
            or now - self._groups_finished_at > self.ft.stop_timeout_s
        )

    def _stragglers_done(self) -> bool:
        # A group still down when its peers finished has nothing left to heal from.
        # Every group finished is ``_every_rank_finished``'s case: it waits for digests.
        finished = [g.finished for g in self.groups]
        return (
            any(finished)
            and not all(finished)
            and all(g.finished or g.lost_at is not None for g in self.groups)
        )
