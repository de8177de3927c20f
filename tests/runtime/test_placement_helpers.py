"""The placement helper stages use, and the embedded head's marks, without Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.train_configs import two_group_tiny_config

from orchestrator.runtime.placement import EMBEDDED_RESOURCE, embedded_marks, node_ids
from stages.placement import (
    MARK_PER_ACTOR,
    NODE_RESOURCE_PREFIX,
    actor_options,
    booking_resource,
    bundle_for_group_rank,
    bundle_for_rank,
    node_resource,
)
from stages.run_facts import PlacementFact, RunFacts
from stages.run_secret import RunSecret
from stages.trainer.fleet.launcher import RankLauncher

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


def test_groups_added_together_take_bundles_of_their_own(tmp_path: Path) -> None:
    # Two groups a resize adds onto the two nodes a booking gained: one node each.
    assert [bundle_for_group_rank(FACTS, 0, 1, g, 2) for g in range(2)] == [0, 1]
    two_ranks = [[bundle_for_group_rank(FACTS, r, 2, g, 2) for r in range(2)] for g in range(2)]
    assert two_ranks == [[0, 0], [1, 1]]
    # The launcher places each added group by its place among those added with it; the
    # run's own groups by their index, over the run's reservation; a standby anywhere.
    cfg = two_group_tiny_config(tmp_path)
    launcher = RankLauncher(
        cfg,
        run_id="r",
        checkpoint_dir=tmp_path,
        facts=FACTS,
        fleet=None,
        secret=RunSecret.new(),
        emit=lambda _e: None,
        announce=lambda _e, _line: None,
    )
    assert [launcher.bundle_index(FACTS, g, 0, (i, 2)) for i, g in enumerate((5, 6))] == [0, 1]
    assert [launcher.bundle_index(FACTS, g, 0, None) for g in range(2)] == [0, 1]
    assert launcher.bundle_index(FACTS, -1, 0, None) == -1


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


def _node(node_id: str, alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 2.0, **resources}}


def test_booking_nodes_are_the_ray_nodes_started_with_their_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    named = {f"{NODE_RESOURCE_PREFIX}gpu-0{i}": 1.0 for i in range(3)}
    nodes = [
        _node("head"),  # unmarked: no work
        *(_node(f"id{i}", **{"booking:bk1": 1.0, k: 1.0}) for i, k in enumerate(named)),
        _node("dead", alive=False, **{f"{NODE_RESOURCE_PREFIX}gpu-09": 1.0}),
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    # In the booking's order, whatever Ray's.
    assert node_ids(["gpu-02", "gpu-00"]) == ("id2", "id0")
    assert node_resource("gpu-00") in named
    # All or nothing: a name no live node carries (not joined, or its host is dead).
    assert node_ids(["gpu-00", "gpu-09"]) == ()
    assert node_ids(["gpu-00", "gpu-07"]) == ()
    assert node_ids([]) == ()
    # One machine serving the booking, its nodes not named: no mapping.
    monkeypatch.setattr(ray, "nodes", lambda: [_node("one", **{"booking:bk1": 1.0})])
    assert node_ids(["bk1-n0", "bk1-n1"]) == ()


def test_bundles_are_pinned_only_to_names_the_booking_nodes_carry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A raylet named by its host (Slurm's node name) where the booking lists names of
    its own: pinning the bundles to the booking's names would wait forever, so they go
    on any node of the booking; raylets that carry the booking's names get one each."""
    import ray

    from orchestrator.runtime.placement import _pinned

    bundle = {"booking:bk1": 1.0, "CPU": 1.0}
    host = _node("h", **{"booking:bk1": 1.0, f"{NODE_RESOURCE_PREFIX}slurm-host": 1.0})
    monkeypatch.setattr(ray, "nodes", lambda: [host])
    assert _pinned(bundle, "booking:bk1", ["bk1-n0"], 1, ["bk1-n0"]) == [bundle]
    named = [
        _node(f"id{i}", **{"booking:bk1": 1.0, node_resource(f"bk1-n{i}"): 1.0}) for i in range(2)
    ]
    monkeypatch.setattr(ray, "nodes", lambda: named)
    assert _pinned(bundle, "booking:bk1", ["bk1-n0", "bk1-n1"], 2, ["bk1-n0", "bk1-n1"]) == [
        {**bundle, node_resource("bk1-n0"): 1.0},
        {**bundle, node_resource("bk1-n1"): 1.0},
    ]
    # an added node, not joined yet, still gets its name: the booking's others carry theirs
    assert _pinned(bundle, "booking:bk1", ["bk1-n2"], 1, ["bk1-n0", "bk1-n1", "bk1-n2"]) == [
        {**bundle, node_resource("bk1-n2"): 1.0}
    ]
