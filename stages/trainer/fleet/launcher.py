"""Making a run's actors: its ranks and standbys, and its torchft lighthouse; or taking
over the ranks (and lighthouse) a ``Fleet`` holds from the previous run of its shape.

Every rank is a ``ReplicaWorker`` actor named ``run-<id>-trainer-rg<N>-rank<M>``
(``<id>`` the run that made it: a fleet handed on keeps its names), placed on the
booking's nodes (``stages.placement``), made with its ``WorkerSpec`` and the run's secret.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.checkpointing.seal import run_binding
from stages.errors import ErrorCode, ItoError
from stages.events import Event, FleetEvent, LogEvent
from stages.placement import actor_options, bundle_for_group_rank
from stages.run_facts import PlacementFact, RunFacts
from stages.run_secret import RunSecret
from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet.handoff import Fleet, kill_actors, write_assignment
from stages.trainer.fleet.lighthouse import LighthouseActor, lighthouse_name
from stages.trainer.fleet.supervision import RankKey
from stages.trainer.rank.control import WorkerSpec
from stages.trainer.rank.replica import BORROWED_GROUP, ReplicaWorker, worker_name


class RankLauncher:
    """``emit`` takes the run's events; ``announce(event, line)`` a fleet change."""

    def __init__(
        self,
        cfg: TrainStageConfig,
        *,
        run_id: str,
        checkpoint_dir: Path,
        facts: RunFacts,
        fleet: Fleet | None,
        secret: RunSecret,
        emit: Callable[[Event], None],
        announce: Callable[[FleetEvent, str], None],
    ):
        self.cfg, self.ft = cfg, cfg.fault_tolerance
        self.run_id = run_id
        self.checkpoint_dir = checkpoint_dir
        self.facts = facts
        self.fleet = fleet
        # The run's secret, handed to every rank as an actor argument; a fleet handed
        # on keeps the one its ranks were made with.
        self.secret = secret
        self.emit, self.announce = emit, announce
        # The run id the actors' names carry (the run that made them).
        self.names_id = run_id
        self.lighthouse: Any = None
        self.lh_addr = ""
        self._starting: threading.Thread | None = None
        self.start_error: BaseException | None = None

    def start_in_background(self, actors: dict[RankKey, Any]) -> None:
        """Make the run's actors into ``actors`` on a thread while the caller goes on
        (data prep, tokenizing); ``wait_started`` waits for it."""
        if self._starting is None:
            if self.fleet is not None:
                self.fleet.placing()
            self._starting = threading.Thread(
                target=self._launch_catching, args=(actors,), name="fleet-start", daemon=True
            )
            self._starting.start()

    def wait_started(self, actors: dict[RankKey, Any]) -> None:
        """Wait for the actors (started now if they were not): re-raises what failed."""
        self.start_in_background(actors)
        self.join()
        if self.start_error is not None:
            raise self.start_error

    def join(self) -> None:
        """Let a start in progress finish (so no actor it makes outlives the run)."""
        if self._starting is not None:
            self._starting.join()

    def _launch_catching(self, actors: dict[RankKey, Any]) -> None:
        try:
            self.launch(actors)
        except BaseException as e:  # re-raised by wait_started in the caller's thread
            self.start_error = e
        finally:
            if self.fleet is not None:  # the ranks the probe may borrow while they warm
                self.fleet.place_done({} if self.start_error else actors)

    def launch(self, actors: dict[RankKey, Any]) -> None:
        import ray

        if not ray.is_initialized():
            raise ItoError(ErrorCode.ray_unavailable, "Ray is not initialised in this process")
        t0 = time.time()
        kept = False
        if self.fleet_fits():  # the ranks are told the lighthouse with their new spec
            self.lh_addr, kept = self._start_lighthouse()
        handed = self._take_fleet(actors)
        if not handed:
            # New ranks first, then a new lighthouse, whose address is not waited for:
            # Ray starts a node's worker processes a few at a time, and the ranks'
            # (imports, model build) are the long pole; each rank asks the lighthouse
            # (by the run's name for it) when it joins, after its build.
            for g in range(self.cfg.replica_groups):
                for r in range(self.cfg.ranks_per_group):
                    actors[(g, r)] = self.make_worker(worker_name(self.names_id, g, r), g, r)
        if self.fleet is not None:  # the ranks the probe borrows: no lighthouse needed
            self.fleet.place_done(actors)
        if self.lighthouse is None:
            self.lh_addr, kept = self._start_lighthouse()
        lh_addr = self.lighthouse_address()
        how = f"{len(actors)} trainer actors" + (
            f" handed on from run {self.names_id}" if handed else ""
        )
        self.announce(
            FleetEvent(
                action="lighthouse_started",
                address=lh_addr,
                actors=[worker_name(self.names_id, g, r) for g, r in actors],
            ),
            f"{'kept' if kept else 'started'} lighthouse {lh_addr} and {how} "
            f"in {time.time() - t0:.1f}s",
        )

    def _start_lighthouse(self) -> tuple[str, bool]:
        """The run's torchft lighthouse (its address, "" for a new one still starting:
        ``lighthouse_address``; and whether it was kept): the fleet's, when the
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
        self.lighthouse = lh_cls.options(
            name=lighthouse_name(self.run_id),
            num_cpus=0.1,
            max_restarts=-1,
            **actor_options(self.facts, bundle_index=0),
        ).remote(
            self.cfg.lighthouse_settings(), 1, self.facts.placement
        )  # its front admits these nodes
        return "", False

    def lighthouse_address(self) -> str:
        """The lighthouse's address, waited for once (at most ``actor_ready_timeout_s``)."""
        import ray

        if not self.lh_addr:
            ref = self.lighthouse.address.remote()
            self.lh_addr = str(ray.get(ref, timeout=self.ft.actor_ready_timeout_s))
        return self.lh_addr

    def _take_fleet(self, actors: dict[RankKey, Any]) -> bool:
        """Start this run on the ranks the fleet holds when it has this run's shape;
        False: there are none (or they cannot serve: their previous loop did not end,
        or the shape differs) and this run makes its own, which it leaves there."""
        import ray

        fleet = self.fleet
        if fleet is None:
            return False
        shape = (self.cfg.replica_groups, self.cfg.ranks_per_group, self.cfg.device)
        if self.fleet_fits():
            assert fleet.secret is not None
            self.lighthouse_address()  # the ranks are told it with their new spec
            self.names_id = fleet.fleet_id
            self.secret = fleet.secret  # Ray restarts its ranks with the one they got
            try:
                # Every group's rank 0 first: it makes the store its group's other ranks
                # then ask it for (ReplicaWorker.reassign).
                for rank0 in (True, False):
                    replies = []
                    for key, actor in fleet.actors.items():
                        if (key[1] == 0) == rank0:
                            spec = self.spec(worker_name(self.names_id, *key), *key)
                            write_assignment(spec)  # first: a restart from here joins this run
                            replies.append(actor.reassign.remote(spec))
                    ray.get(replies, timeout=self.ft.actor_ready_timeout_s)
                actors.update(fleet.actors)
                return True
            except Exception as e:  # a rank died between the runs, or never finished
                self.emit(LogEvent(level="warning", message=f"fleet not handed on: {e}"))
        fleet.kill_ranks()
        fleet.fleet_id, fleet.shape, fleet.secret = self.run_id, shape, self.secret
        self.names_id = self.run_id
        return False

    def fleet_fits(self) -> bool:
        """Whether the fleet holds ranks of this run's shape to hand on."""
        fleet = self.fleet
        shape = (self.cfg.replica_groups, self.cfg.ranks_per_group, self.cfg.device)
        return (
            fleet is not None
            and bool(fleet.actors)
            and fleet.shape == shape
            and fleet.secret is not None
        )

    def spec(
        self,
        name: str,
        group: int,
        rank: int,
        standby_index: int | None = None,
        facts: RunFacts | None = None,
        *,
        joining: bool = False,
        membership_from: tuple[int, tuple[int, ...]] | None = None,
    ) -> WorkerSpec:
        return WorkerSpec(
            run_id=self.run_id,
            replica_group=group,
            rank=rank,
            config=self.cfg,
            lighthouse_addr=self.lh_addr,
            checkpoint_dir=str(self.checkpoint_dir),
            standby_index=standby_index,
            fleet_id=self.names_id,
            assignment_path=self.fleet.assignment_path(name) if self.fleet else "",
            account=run_binding(self.run_id, self.facts).account,
            placement=(facts or self.facts).placement,
            joining=joining,
            membership_from=membership_from,
        )

    def make_worker(
        self,
        name: str,
        group: int,
        rank: int,
        standby_index: int | None = None,
        *,
        joining: bool = False,
        membership_from: tuple[int, tuple[int, ...]] | None = None,
        placement: PlacementFact | None = None,
        place: tuple[int, int] = (0, 1),
    ) -> Any:
        """Rank ``rank`` of ``group`` (-1: of standby ``standby_index``). ``joining``: a
        group a resize adds to the running run; ``placement``: the reservation of the
        nodes the booking gained, for it, instead of the run's own, and ``place`` the
        group's place among the groups added into it and their count."""
        import ray

        facts = self.facts if placement is None else RunFacts(placement=placement)
        spec = self.spec(
            name,
            group,
            rank,
            standby_index,
            facts,
            joining=joining,
            membership_from=membership_from,
        )
        if spec.assignment_path:
            write_assignment(spec)  # replaces one an earlier driver of the run left
        index = self.bundle_index(facts, group, rank, None if placement is None else place)
        return (
            # Work that borrows the rank before its run trains (the ladder probe) runs
            # in a concurrency group of its own, beside the driver's calls.
            ray.remote(concurrency_groups={BORROWED_GROUP: 1})(  # type: ignore[call-overload]
                ReplicaWorker
            )
            .options(
                name=name,
                num_cpus=self.cfg.worker_num_cpus,
                **actor_options(facts, bundle_index=index),
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

    def bundle_index(
        self, facts: RunFacts, group: int, rank: int, added: tuple[int, int] | None
    ) -> int:
        """The bundle (node) of rank ``rank`` of ``group`` in ``facts``' reservation: the
        run's groups spread over its own, each group a resize adds over the nodes the
        booking gained, beside the others added with it (``added``: its place among
        them and their count). -1: a standby (it takes a lost rank's device later)."""
        rpg = self.cfg.ranks_per_group
        if added is not None:
            return bundle_for_group_rank(facts, rank, rpg, *added)
        if group < 0:
            return -1
        return bundle_for_group_rank(facts, rank, rpg, group, self.cfg.replica_groups)

    @staticmethod
    def restart_group(actors: dict[RankKey, Any], dead: RankKey) -> None:
        """A multi-rank group is one failure unit: its other ranks are killed too and
        Ray restarts them all, around a fresh store hosted by the new rank 0."""
        import ray

        for (g, r), actor in actors.items():
            if g == dead[0] and r != dead[1]:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=False)
