"""Which addresses a run's fronts admit: the nodes of its placement group's bundles, as
Ray registered them (a real local Ray and a real placement group)."""

from __future__ import annotations

import pytest

from stages.netfront import run_node_addresses
from stages.placement import PLACEMENT_FACT

pytestmark = pytest.mark.slow
READY_TIMEOUT_S = 60.0  # a hang guard


def test_the_run_admits_its_placement_groups_nodes(ray_local: None) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.01}], name="run-nodes-pg")
    ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    try:
        fact = {
            "booking_id": "bk",
            "resource": "CPU",
            "placement_group": "run-nodes-pg",
            "placement_group_id": pg.id.hex(),
            "bundles": 1,
        }
        node = ray.util.get_node_ip_address()
        assert run_node_addresses({PLACEMENT_FACT: fact}) == {node}
        # A stage run alone (no placement): every alive node of the Ray cluster.
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert run_node_addresses(None) == alive
    finally:
        remove_placement_group(pg)
