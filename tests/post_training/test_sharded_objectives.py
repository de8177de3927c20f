"""Post-training's objectives train on the run's replica groups with their ranks: SFT
and then DPO on one group of two FSDP ranks (real Ray actors, torchft, gloo, FSDP2),
each scored and exported from the sharded model, DPO in SFT's two processes. The
group's process group goes on from run to run; torchft's Manager gets a fresh store
from rank 0 for each (a reused one hands DPO's second rank SFT's dead Manager)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.tenants import DEFAULT_ROOTS
from helpers.waiting import wait_until

from orchestrator.runtime.ray_cluster import _alive
from stages.base import StageContext
from stages.events import FleetEvent, StepEvent
from stages.trainer import replica_group_pids
from stages.trainer.parallel.layout import ParallelLayout
from tests.post_training.conftest import base_model, data_ref, learner_layout

WAIT_S = 120.0  # a hang guard on a loaded 2-core machine, never a speed claim


@pytest.mark.timeout(600)
def test_sft_then_dpo_on_a_group_of_two_fsdp_ranks_in_the_same_processes(
    ray_local: None, tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    import ray

    from stages.post_training import PostTrainingStage, PostTrainingStageConfig

    train = learner_layout(
        tmp_path,
        replica_groups=1,
        ranks_per_group=2,
        parallel=ParallelLayout(dp_shard=2),
        worker_num_cpus=0.5,
    )
    recipe = {
        **base_model(tiny_policy),
        "sft": {"data": data_ref(task_files["sft"]), "steps": 6, "learning_rate": 5e-3},
        "dpo": {"data": data_ref(task_files["dpo"]), "steps": 4, "learning_rate": 1e-3},
    }
    stage = PostTrainingStage(
        PostTrainingStageConfig.model_validate(
            {
                "recipe": recipe,
                "output_dir": str(tmp_path / "out"),
                "train": train.model_dump(mode="json"),
                "data_roots": DEFAULT_ROOTS,
                "model_roots": DEFAULT_ROOTS,
            }
        )
    )
    events: list[Any] = []
    pids: dict[str, list[int]] = {}
    groups: dict[str, list[int]] = {}
    loops: dict[str, list[int]] = {}

    def emit(e: Any) -> None:
        events.append(e)
        if isinstance(e, StepEvent) and e.phase not in pids:
            pids[e.phase] = sorted(replica_group_pids(f"s-{e.phase}"))
            ranks = [ray.get_actor(f"run-s-sft-trainer-rg0-rank{r}") for r in (0, 1)]
            who = ray.get([a.identity.remote() for a in ranks], timeout=WAIT_S)
            groups[e.phase] = [w["process_groups"] for w in who]
            loops[e.phase] = [w["loops"] for w in who]

    ctx = StageContext(run_id="s", booking_id="b", workdir=tmp_path / "w", emit=emit)
    out = stage.run(ctx)
    assert out.status == "passed", out.reason
    m = out.metrics
    assert m["sft_steps"] == 6.0 and m["dpo_steps"] == 4.0
    assert m["sft_nll_gain"] > 0 and m["dpo_margin_gain"] > 0
    for objective in ("sft", "dpo"):  # written from the sharded model's gathered weights
        assert (tmp_path / "out" / objective / "model.safetensors").is_file()
    # DPO ran on SFT's two ranks, in the same processes, under the same lighthouse.
    started = [e for e in events if isinstance(e, FleetEvent) and e.action == "lighthouse_started"]
    assert [e.actors for e in started] == [
        ["run-s-sft-trainer-rg0-rank0", "run-s-sft-trainer-rg0-rank1"]
    ] * 2
    assert started[0].address == started[1].address
    assert len(pids["sft"]) == 2 and pids["dpo"] == pids["sft"]
    # DPO's layout is SFT's: its ranks train on SFT's mesh and DCP group, not new ones.
    assert groups["sft"][0] > 1 and groups["dpo"] == groups["sft"], groups
    # SFT's loop (its model and optimizer) went at the hand-over: one loop a rank.
    assert loops == {"sft": [1, 1], "dpo": [1, 1]}, loops
    wait_until(lambda: not any(map(_alive, pids["dpo"])), WAIT_S, "the fleet is killed")
