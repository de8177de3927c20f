"""A grow's new ranks (``GroupResizer``'s ``launching`` and ``joining`` stages): each new
group is an idle warm standby promoted to it (a replacement standby starts on the nodes
the booking gained) or freshly launched ranks there; at the held step they are released
into the run. The reservations of gained nodes the added groups run in are kept here
until every group in one drained, and then given back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from stages.events import Event, LogEvent
from stages.placement import release_added
from stages.resize import ResizeRequest
from stages.run_facts import PlacementFact
from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet.handoff import kill_actors
from stages.trainer.fleet.launcher import RankLauncher
from stages.trainer.fleet.standby import StandbyPool
from stages.trainer.fleet.supervision import RankKey
from stages.trainer.rank.replica import worker_name


class GrowHost(Protocol):
    """What a grow needs of the engine: its config, launcher, standbys and data."""

    cfg: TrainStageConfig
    launcher: RankLauncher
    standby: StandbyPool
    role_shards: dict[str, list[str]] | None

    def emit(self, event: Event) -> None: ...


class GrowLaunch:
    """``log_progress(what)``: a resize's milestone, with the seconds since the booking
    changed."""

    def __init__(self, engine: GrowHost, log_progress: Callable[[str], None]):
        self.engine = engine
        self.log_progress = log_progress
        # The joining ranks that are promoted warm standbys (activated at the hold), by
        # their actors' names.
        self.promoted: dict[RankKey, str] = {}
        self.launched_at = 0.0  # when a grow's new ranks were launched (epoch seconds)
        # The added groups by the reservation of gained nodes they run in: given back
        # once none of them is left (drained and stopped).
        self.placed: dict[int, PlacementFact] = {}

    def start(
        self,
        added: list[int],
        request: ResizeRequest,
        resume: tuple[int, tuple[int, ...]] | None,
    ) -> dict[RankKey, Any]:
        """The ranks of the groups ``added`` by ``request``, by key: promoted standbys or
        launched ranks (``resume``: after a pause, the checkpoint's step and the members
        from it; the new groups read it, and no standby is promoted)."""
        engine = self.engine
        joining: dict[RankKey, Any] = {}
        self.launched_at = time.time()
        for place, g in enumerate(added):
            if request.placement is not None:
                self.placed[g] = request.placement
            if resume is None and (taken := self._promote(g, request, (place, len(added)))):
                joining.update(taken)
                continue
            for r in range(engine.cfg.ranks_per_group):
                key = (g, r)
                joining[key] = engine.launcher.make_worker(
                    worker_name(engine.launcher.names_id, g, r),
                    g,
                    r,
                    joining=resume is None,
                    membership_from=resume,
                    placement=request.placement,
                    place=(place, len(added)),
                )
                # The data goes with the rank: it joins without waiting for a poll.
                joining[key].command.remote("data", {"role_shards": engine.role_shards})
        return joining

    def _promote(
        self, group: int, request: ResizeRequest, place: tuple[int, int]
    ) -> dict[RankKey, Any] | None:
        """Make an idle warm standby group the new group ``group`` (activated once every
        group holds), and start its replacement standby on the nodes the booking gained
        (``place``: the new group's place among those added there). None: none is warm,
        or it cannot take the group (on cuda a standby holds no device to train on)."""
        engine = self.engine
        if engine.cfg.device == "cuda":
            return None
        taken = engine.standby.promote(group, placement=request.placement, place=place)
        if taken is None:
            return None
        ranks: dict[RankKey, Any] = {}
        for rank, (name, actor) in enumerate(taken):
            ranks[(group, rank)] = actor
            self.promoted[(group, rank)] = name
        self.log_progress(
            f"standby {', '.join(n for n, _ in taken)} becomes replica group {group} "
            "(warm: nothing to launch)"
        )
        return ranks

    def release(self, joining: dict[RankKey, Any]) -> None:
        """The new ranks join the run now, at the held step."""
        for key, actor in joining.items():
            if key in self.promoted:
                # The standby joins now, at the held step, as a lost group's stand-in does.
                actor.command.remote("data", {"role_shards": self.engine.role_shards})
                activation = self.engine.standby.activation(*key)
                actor.command.remote("activate", {**activation, "joining": True})
            else:
                actor.command.remote("go")

    def release_drained(self, kept: set[int]) -> None:
        """Give back each reservation of gained nodes whose groups all drained (none of
        them in ``kept``: their ranks stopped and killed): the booking took those nodes
        back, or the count dropped below them."""
        for g in [g for g in self.placed if g not in kept]:
            placement = self.placed.pop(g)
            still = {p.placement_group_id for p in self.placed.values()}
            if placement.placement_group_id in still:
                continue
            # A standby started there when a grow promoted one moves to the run's nodes.
            kill_actors(*self.engine.standby.move_off(placement.placement_group_id))
            if release_added(placement):
                self.engine.emit(
                    LogEvent(
                        message=f"released the reservation {placement.placement_group}: "
                        "its replica groups drained"
                    )
                )
