"""What the resize tests share: a stored plan and the placement of added nodes on the
embedded head."""

from __future__ import annotations

from typing import Any

from orchestrator.runtime.placement import PlacementSettings, reserve_added
from stages.run_facts import PlacementFact

# 4 groups of 4 ranks (tp 2 x dp_shard 2) on a booking of 2 nodes x 8 GPUs, a global
# batch of 48 sequences: as the parallelism stage stores it (the fields read here).
PLAN: dict[str, Any] = {
    "tp": 2,
    "pp": 1,
    "cp": 1,
    "dp_shard": 2,
    "dp_replicate": 4,
    "grad_accum": 1,
    "pp_microbatches": 0,
    "global_batch_tokens": 48 * 256,
    "seq_len": 256,
    "gpus_per_node": 8,
    "node_count": 2,
}


def embedded_place(
    run_id: str, change_id: int, booking: dict[str, Any], nodes: int
) -> PlacementFact | None:
    """The supervisor's placement of added nodes on the embedded head (one machine):
    the run's own group serves. Reserving real nodes: tests/runtime/test_resizing_on_ray.py."""
    return reserve_added(run_id, change_id, booking, nodes, PlacementSettings(), embedded=True)
