"""The warm standby pool's moves between reservations: a grow's promotion starts the
replacement standby on the nodes the booking gained, and when that reservation is
given back (its groups drained) the standby there leaves it for the run's own nodes.
The pool is built with fakes for its actors (no Ray)."""

from __future__ import annotations

from typing import Any

from stages.events import FleetEvent
from stages.run_facts import PlacementFact
from stages.trainer.fleet.standby import StandbyPool


def _gained(name: str, pg_id: str) -> PlacementFact:
    """A reservation of nodes a booking change gave the run."""
    return PlacementFact(
        booking_id="bk",
        resource="booking:bk",
        placement_group=name,
        placement_group_id=pg_id,
        bundles=1,
    )


def _pool() -> tuple[StandbyPool, list[tuple[str, PlacementFact | None]], dict[str, object]]:
    """A pool of one-rank standby groups; returns it, the (name, placement) of every
    standby it starts, and their actors by name."""
    started: list[tuple[str, PlacementFact | None]] = []
    actors: dict[str, object] = {}

    def make(name: str, rank: int, index: int, placement: Any, place: Any) -> object:
        started.append((name, placement))
        actors[name] = object()
        return actors[name]

    pool = StandbyPool(
        ranks_per_group=1,
        name=lambda index, rank: f"standby-{index}-{rank}",
        make=make,
        due=lambda _name, _now: False,
        announce=lambda _event, _message: None,
    )
    return pool, started, actors


def test_a_standby_on_gained_nodes_moves_to_the_run_s_nodes_when_they_are_given_back() -> None:
    pool, started, actors = _pool()
    gained, other = _gained("run-r-pg-c3", "cd" * 18), _gained("run-r-pg-c4", "ef" * 18)
    pool.start_one()  # standby 0, on the run's own nodes
    pool.ready.add("standby-0-0")
    # A grow promotes standby 0; its replacement (standby 1) starts on the gained nodes.
    taken = pool.promote(2, placement=gained, place=(0, 1))
    assert taken == [("standby-0-0", actors["standby-0-0"])]
    pool.start_one(other)  # standby 2, in another reservation that is kept
    pool.ready.update({"standby-1-0", "standby-2-0"})
    pool.pending["standby-1-0"] = object()  # its poll in flight
    started.clear()

    moved = pool.move_off(gained.placement_group_id)

    assert moved == [actors["standby-1-0"]]  # for the caller to kill
    assert started == [("standby-3-0", None)]  # its replacement, on the run's own nodes
    assert set(pool.groups) == {2, 3} and set(pool.spares) == {"standby-2-0", "standby-3-0"}
    assert pool.placed == {2: other}
    assert pool.ready == {"standby-2-0"} and pool.pending == {}
    # Nothing else runs in the given-back reservation: a second look moves nothing.
    assert pool.move_off(gained.placement_group_id) == [] and started == [("standby-3-0", None)]


def test_a_reservation_with_no_standby_moves_none() -> None:
    pool, started, _ = _pool()
    pool.start_one()
    started.clear()
    announced: list[FleetEvent] = []
    pool.announce = lambda event, _message: announced.append(event)
    assert pool.move_off("cd" * 18) == []
    assert started == [] and set(pool.groups) == {0} and announced == []
