"""The run's warm standby groups: started once the fleet trains, polled until warm, and
taken whole to stand in a lost replica group's place (``stand_in``) or to become a group
a resize adds (``promote``).

A standby group has as many ranks as a replica group; each is a ``ReplicaWorker``
made with group -1 that builds its model and runs one warm-up step at idle priority
(``RankState.standby`` once warm), holding no device until it is activated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stages.events import FleetEvent
from stages.run_facts import PlacementFact
from stages.trainer.fleet.handoff import kill_actors
from stages.trainer.fleet.supervision import RankKey
from stages.trainer.rank.control import CommandParams
from stages.trainer.rank.rank_state import RankState


class StandbyPool:
    """``make(name, rank, standby_index, placement, place)`` makes one standby rank's
    actor (in ``placement``, a reservation of gained nodes, at its ``place`` among the
    groups there and their count; None: on the run's own nodes); ``due(name, now)``
    says whether its next poll is due (the engine's one poll schedule); ``announce``
    tells the run a fleet change."""

    def __init__(
        self,
        *,
        ranks_per_group: int,
        name: Callable[[int, int], str],
        make: Callable[[str, int, int, PlacementFact | None, tuple[int, int]], Any],
        due: Callable[[str, float], bool],
        announce: Callable[[FleetEvent, str], None],
    ):
        self.ranks_per_group = ranks_per_group
        self.name, self.make, self.due, self.announce = name, make, due, announce
        self.spares: dict[str, Any] = {}  # every standby rank's actor, by name
        self.pending: dict[str, Any] = {}  # polls in flight, by name
        self.ready: set[str] = set()  # names reported warm
        # Standby group index -> its ranks' names, while it is a standby.
        self.groups: dict[int, list[str]] = {}
        # Standby group index -> the reservation of gained nodes it runs in (a grow's
        # replacement standby); not listed: the run's own.
        self.placed: dict[int, PlacementFact] = {}
        self.made = 0
        # Each rank's devices as Ray assigned them (cuda): what a standby binds.
        self.gpu_ids: dict[RankKey, list[str]] = {}

    def start_one(
        self, placement: PlacementFact | None = None, place: tuple[int, int] = (0, 1)
    ) -> None:
        """Start one standby group (in ``placement``, a reservation of gained nodes, at
        ``place`` there; None: on the run's own nodes)."""
        index = self.made
        self.made += 1
        names = [self.name(index, r) for r in range(self.ranks_per_group)]
        self.groups[index] = names
        if placement is not None:
            self.placed[index] = placement
        for r, name in enumerate(names):
            self.spares[name] = self.make(name, r, index, placement, place)

    def take_warm(self) -> list[tuple[str, Any]] | None:
        """The lowest warm standby group's (name, actor) by rank, no longer a standby;
        None: none is warm."""
        warm = [i for i, names in self.groups.items() if self.ready >= set(names)]
        if not warm:
            return None
        taken = []
        self.placed.pop(min(warm), None)
        for name in self.groups.pop(min(warm)):
            self.ready.discard(name)
            self.pending.pop(name, None)
            taken.append((name, self.spares.pop(name)))
        return taken

    def stand_in(
        self, group: int, actors: dict[RankKey, Any], in_flight: dict[RankKey, Any]
    ) -> list[str] | None:
        """Put the lowest warm standby group in the place of lost group ``group`` (in
        ``actors``, its ranks' polls in flight dropped): every rank of the lost group is
        replaced (a multi-rank group is one failure unit, so its survivors go too), and
        the standby's ranks form the group's process group around their own store.
        Returns their names; None: no standby group is warm."""
        taken = self.take_warm()
        if taken is None:
            return None
        for rank, (_, spare) in enumerate(taken):
            # The lost group's actors would be restarted by Ray as a second copy of it.
            kill_actors(actors[(group, rank)])
            in_flight.pop((group, rank), None)
            actors[(group, rank)] = spare
            spare.command.remote("activate", self.activation(group, rank))
        names = [name for name, _ in taken]
        self.announce(
            FleetEvent(action="standby_activated", replica_group=group, actors=names),
            f"spare {', '.join(names)} takes the place of replica group {group}",
        )
        self.start_one()
        return names

    def promote(
        self, group: int, *, placement: PlacementFact | None, place: tuple[int, int]
    ) -> list[tuple[str, Any]] | None:
        """The lowest warm standby group, taken to become group ``group`` that a resize
        adds (the resizer activates it at the held step); its replacement starts in
        ``placement`` (the nodes the booking gained) at ``place``, so the run keeps its
        standby count. None: no standby group is warm."""
        taken = self.take_warm()
        if taken is None:
            return None
        names = [name for name, _ in taken]
        self.announce(
            FleetEvent(action="standby_activated", replica_group=group, actors=names),
            f"spare {', '.join(names)} becomes replica group {group}, which a resize adds",
        )
        self.start_one(placement, place)
        return taken

    def move_off(self, placement_group_id: str) -> list[Any]:
        """The standby groups in reservation ``placement_group_id`` (about to be given
        back) leave it: their actors are returned (the caller kills them) and as many
        start on the run's own nodes."""
        moving = [i for i, p in self.placed.items() if p.placement_group_id == placement_group_id]
        actors = []
        for index in moving:
            del self.placed[index]
            for name in self.groups.pop(index):
                self.ready.discard(name)
                self.pending.pop(name, None)
                actors.append(self.spares.pop(name))
        for _ in moving:
            self.start_one()
        return actors

    def activation(self, group: int, rank: int) -> CommandParams:
        """What a standby is told when it becomes rank ``rank`` of ``group``: the group,
        and on cuda the device of the rank it replaces (the standby holds none)."""
        return {"group": group, "gpu_ids": self.gpu_ids.get((group, rank), [])}

    def idle(self) -> list[str]:
        """The standbys with no poll in flight (only they have a turn coming)."""
        return [n for n in self.spares if n not in self.pending]

    def poll(self) -> None:
        """Ask every standby whose turn it is, and take in the answers ready now."""
        import ray

        now = time.monotonic()
        for name, actor in self.spares.items():
            if name not in self.pending and self.due(name, now):
                self.pending[name] = actor.poll.remote()
        refs = {ref: name for name, ref in self.pending.items()}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            name = refs[ref]
            del self.pending[name]
            try:
                report = ray.get(ref, timeout=0).report
            except Exception:  # a dead spare: Ray restarts it, it warms up again
                self.ready.discard(name)
                continue
            if report.state is RankState.standby and name not in self.ready:
                self.ready.add(name)
                self.announce(
                    FleetEvent(action="standby_warm", actors=[name]), f"standby {name} is warm"
                )

    def release(self) -> list[Any]:
        """Every standby's actor, forgotten here (the engine kills them)."""
        actors = list(self.spares.values())
        self.spares.clear()
        return actors
