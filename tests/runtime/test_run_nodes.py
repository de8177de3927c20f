"""Which addresses a run's fronts admit: the nodes of its placement groups' bundles (its
own and those of nodes its booking gained), as Ray registered them (a real local Ray
and real placement groups; one machine is one node, so which nodes a table's groups
name is read from a table of three)."""

from __future__ import annotations

from typing import Any

import pytest

from stages.netfront import reserved_node_ids, run_node_addresses
from stages.run_facts import PlacementFact

READY_TIMEOUT_S = 60.0  # a hang guard


@pytest.mark.slow
def test_the_run_admits_its_placement_groups_nodes(ray_local: None) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.01}], name="run-nodes-pg")
    added = placement_group([{"CPU": 0.01}], name="run-nodes-pg-c1")
    ray.get([pg.ready(), added.ready()], timeout=READY_TIMEOUT_S)
    try:
        fact = PlacementFact(
            booking_id="bk",
            resource="CPU",
            placement_group="run-nodes-pg",
            placement_group_id=pg.id.hex(),
            bundles=1,
        )
        node = ray.util.get_node_ip_address()
        assert run_node_addresses(fact) == {node}
        # A stage run alone (no placement): every alive node of the Ray cluster.
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert run_node_addresses(None) == alive
        # A group added on a gained node: Ray's table names both of the run's groups.
        node_id = ray.get_runtime_context().get_node_id()
        table = ray.util.placement_group_table()
        assert reserved_node_ids(table, "run-nodes-pg-c1", added.id.hex()) == {node_id}
        assert {t["name"] for t in table.values()} >= {"run-nodes-pg", "run-nodes-pg-c1"}
    finally:
        remove_placement_group(pg)
        remove_placement_group(added)


def _group(gid: str, name: str, nodes: list[str], state: str = "CREATED") -> dict[str, Any]:
    """One row of Ray's placement group table (the fields read)."""
    return {
        "placement_group_id": gid,
        "name": name,
        "state": state,
        "bundles_to_node_id": dict(enumerate(nodes)),
    }


def test_a_runs_fronts_admit_the_nodes_of_all_its_reservations_and_no_other() -> None:
    table = {
        "g1": _group("g1", "run-r1-pg", ["na", "nb"]),
        "g2": _group("g2", "run-r1-pg-c3", ["nc"]),  # the node a booking change gave r1
        "g3": _group("g3", "run-r1-pg-c1", ["nd"], state="REMOVED"),  # r1's, gone
        "g4": _group("g4", "run-r2-pg", ["ne"]),  # another run
        "g5": _group("g5", "run-r2-pg-c3", ["nf"]),  # another run's added node
    }
    # The run's first ranks (and its lighthouse) admit the added group's node, and the
    # added group's ranks admit the run's first nodes.
    assert reserved_node_ids(table, "run-r1-pg", "g1") == {"na", "nb", "nc"}
    assert reserved_node_ids(table, "run-r1-pg-c3", "g2") == {"na", "nb", "nc"}
    assert reserved_node_ids(table, "run-r2-pg", "g4") == {"ne", "nf"}
