"""The learner fleet is handed from objective to objective: SFT and DPO train in the
same trainer processes (real Ray actors) under the same torchft lighthouse, and a
rank SIGKILLed during DPO is restarted by Ray as a DPO rank (it reads its assignment,
not the SFT spec it was made with) that resumes DPO from its newest checkpoint; the
stage's end kills the fleet and its lighthouse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
from helpers.tenants import DEFAULT_ROOTS
from helpers.waiting import wait_until

from orchestrator.runtime.ray_cluster import _alive
from stages.base import StageContext
from stages.events import CheckpointEvent, FleetEvent, StepEvent
from stages.trainer import kill_replica_group, replica_group_pids
from stages.trainer.fleet.lighthouse import lighthouse_name
from tests.post_training.conftest import base_model, data_ref, learner_layout

WAIT_S = 120.0  # a hang guard on a loaded 2-core machine, never a speed claim


@pytest.mark.timeout(600)
def test_dpo_trains_in_sfts_processes_and_a_rank_killed_in_dpo_rejoins_dpo(
    ray_local: None, tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    from stages.post_training import PostTrainingStage, PostTrainingStageConfig

    # One learner group, paced so that DPO outlasts the kill and the restart.
    train = learner_layout(tmp_path, replica_groups=1, pace_step_s=0.1)
    dpo_steps = 40
    recipe = {
        **base_model(tiny_policy),
        "sft": {"data": data_ref(task_files["sft"]), "steps": 4, "learning_rate": 5e-3},
        "dpo": {
            "data": data_ref(task_files["dpo"]),
            "steps": dpo_steps,
            "learning_rate": 1e-3,
            "checkpoint_every_steps": 4,
            "gate": None,
        },
    }
    stage = PostTrainingStage(
        PostTrainingStageConfig.model_validate(
            {
                "recipe": recipe,
                "output_dir": str(tmp_path / "out"),
                "fleet": "local",
                "train": train.model_dump(mode="json"),
                "data_roots": DEFAULT_ROOTS,
                "model_roots": DEFAULT_ROOTS,
            }
        )
    )
    events: list[Any] = []
    seen: dict[str, Any] = {}

    def emit(e: Any) -> None:
        events.append(e)
        if isinstance(e, StepEvent) and e.phase == "sft" and "sft" not in seen:
            seen["sft"] = replica_group_pids("h-sft")
        if isinstance(e, StepEvent) and e.phase == "dpo" and "named" not in seen:
            seen["named"] = ray.util.list_named_actors()
        if (
            isinstance(e, CheckpointEvent)
            and e.phase == "dpo"
            and e.step >= 8
            and not seen.get("killed")
        ):
            seen["killed"] = kill_replica_group("h-dpo", 0)

    out = stage.run(StageContext(run_id="h", booking_id="b", workdir=tmp_path / "w", emit=emit))
    assert out.status == "passed", out.reason

    # DPO started on the processes SFT trained in: the same actors, the same pids.
    started = [e for e in events if isinstance(e, FleetEvent) and e.action == "lighthouse_started"]
    assert len(started) == 2 and started[0].actors == started[1].actors
    assert started[0].address == started[1].address  # SFT's lighthouse went on too
    assert started[0].actors == ["run-h-sft-trainer-rg0-rank0"]
    killed_at, killed_pids = seen["killed"]
    assert seen["sft"] and killed_pids == seen["sft"]
    # The restarted process rejoined DPO: it restored DPO's newest checkpoint and DPO
    # trained to its end (an SFT spec would have restored SFT's and never gone on).
    restored = [
        e
        for e in events
        if isinstance(e, FleetEvent) and e.action == "checkpoint_restored" and e.ts > killed_at
    ]
    assert restored and restored[0].step is not None and 8 <= restored[0].step < dpo_steps
    dpo = [e.step for e in events if isinstance(e, StepEvent) and e.phase == "dpo" and e.committed]
    assert max(dpo) == dpo_steps
    assert any(e.ts > killed_at for e in events if isinstance(e, StepEvent) and e.phase == "dpo")
    # The stage's end kills the fleet it handed on, and its lighthouse.
    wait_until(lambda: not replica_group_pids("h-dpo"), WAIT_S, "the fleet is killed")
    assert not any(map(_alive, killed_pids))
    assert lighthouse_name("h-sft") in seen["named"]  # SFT's, alive in DPO
    wait_until(
        lambda: lighthouse_name("h-sft") not in ray.util.list_named_actors(),
        WAIT_S,
        "the lighthouse is killed",
    )
