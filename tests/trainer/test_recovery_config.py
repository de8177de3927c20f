"""One function decides how a run recovers: the pipeline launches it and the
fault-tolerance benchmark measures it (no configuration only the benchmark runs)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers.manifests import example_manifest

from orchestrator.runtime.launch import LaunchSpec
from orchestrator.runtime.pipeline import build_pipeline
from stages.base import GateOutcome, StageContext
from stages.trainer.fleet.recovery import STANDBYS_PER_NODE, production_recovery

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _train_config(tmp_path: Path, booking: dict[str, int], plan: dict[str, int]):
    spec = LaunchSpec(
        run_id="run_1",
        booking_id="bk_1",
        account="acme",
        manifest_digest="d" * 64,
        manifest_json=json.dumps(example_manifest(tmp_path / "ckpt")),
        accepted_at=time.time(),
        workdir=str(tmp_path / "w"),
        checkpoint_dir=str(tmp_path / "c"),
        facts={"booking": booking},
    )
    make = dict(build_pipeline(spec))["train"]
    ctx = StageContext(run_id="run_1", booking_id="bk_1", workdir=tmp_path)
    ctx.previous["parallelism"] = GateOutcome(
        stage="parallelism", status="passed", reason="", artifacts={"plan": plan}
    )
    return make(ctx).config  # type: ignore[attr-defined]


@pytest.mark.parametrize("nodes", [1, 3])
def test_the_pipeline_launches_the_production_recovery(tmp_path: Path, nodes: int) -> None:
    booking = {"node_count": nodes, "gpus_per_node": 2}
    cfg = _train_config(
        tmp_path, booking, {"dp_replicate": 2 * nodes, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}
    )
    want = production_recovery(booking)
    # A warm standby on every node, by default.
    assert cfg.spare_groups == want.spare_groups == STANDBYS_PER_NODE * nodes > 0
    assert cfg.fault_tolerance == want.fault_tolerance


def test_the_benchmark_defaults_are_the_production_recovery() -> None:
    import fault_tolerance as bench

    args = bench.parse_args([])
    want = production_recovery({"node_count": 1, "gpus_per_node": args.groups})
    assert args.spares == want.spare_groups > 0
    assert bench.recovery(args).fault_tolerance == want.fault_tolerance


def test_each_group_gets_its_own_cores() -> None:
    from stages.trainer.rank.replica import group_cores

    assert [group_cores(g, 2, [0, 1]) for g in range(2)] == [[0], [1]]
    assert [group_cores(g, 2, [0, 1, 2, 3]) for g in range(2)] == [[0, 1], [2, 3]]
    # More groups than cores: they share, round robin.
    assert [group_cores(g, 3, [4, 5]) for g in range(3)] == [[4], [5], [4]]
