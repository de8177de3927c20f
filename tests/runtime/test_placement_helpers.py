"""The placement helper stages use, and the embedded head's marks, without Ray."""

from __future__ import annotations

from orchestrator.runtime.placement import EMBEDDED_RESOURCE, embedded_marks
from stages.placement import (
    MARK_PER_ACTOR,
    actor_options,
    booking_resource,
    bundle_for_rank,
)
from stages.run_facts import PlacementFact, RunFacts

FACTS = RunFacts(
    placement=PlacementFact(
        booking_id="bk1",
        resource="booking:bk1",
        placement_group="run-r-pg",
        placement_group_id="ab" * 18,
        bundles=2,
        bundle={"booking:bk1": 4.0},
    )
)


def test_without_placement_a_stage_schedules_freely() -> None:
    assert actor_options(RunFacts()) == actor_options(None) == {}
    assert actor_options(RunFacts(), resources={"x": 1.0}) == {"resources": {"x": 1.0}}
    assert bundle_for_rank(RunFacts(), 3, 8) == -1


def test_ranks_spread_over_nodes_consecutively() -> None:
    assert [bundle_for_rank(FACTS, r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [bundle_for_rank(FACTS, r, 3) for r in range(3)] == [0, 0, 1]
    assert bundle_for_rank(FACTS, 0, 1) == 0


def test_placed_actor_takes_a_token_of_the_booking_mark_in_the_group() -> None:
    opts = actor_options(FACTS, bundle_index=1, resources={"x": 2.0})
    assert opts["resources"] == {"x": 2.0, "booking:bk1": MARK_PER_ACTOR}
    strategy = opts["scheduling_strategy"]
    assert strategy.placement_group_bundle_index == 1
    assert strategy.placement_group.id.hex() == "ab" * 18
    assert strategy.placement_group_capture_child_tasks is True


def test_embedded_head_is_marked_with_each_booking_and_the_catch_all() -> None:
    marks = embedded_marks(
        [{"booking_id": "bk1", "gpus_per_node": 2}, {"booking_id": "bk2", "gpus_per_node": None}]
    )
    assert marks[booking_resource("bk1")] == 2.0
    assert marks[booking_resource("bk2")] == 1.0
    assert EMBEDDED_RESOURCE in marks
