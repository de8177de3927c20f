"""A driver relaunched during DPO: the stage runs again in the same work and output
folders (what a relaunched RunDriver does); SFT, whose gate passed, is not trained
again, and DPO resumes on the engine from its newest checkpoint, not step 0. The first
driver stops by cancel (every actor of its engine killed), as the curriculum's
relaunch test does; the SIGKILL of a RunDriver actor and its relaunch by the
supervisor are tests/runtime/test_runs_on_ray.py's."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from helpers.tenants import DEFAULT_ROOTS
from helpers.waiting import wait_until

from orchestrator.runtime.ray_cluster import _alive
from stages.base import StageContext
from stages.checkpointing.storage import list_checkpoints
from stages.events import CheckpointEvent, StepEvent
from stages.trainer import replica_group_pids
from tests.post_training.conftest import base_model, data_ref

WAIT_S = 600.0  # a hang guard on a loaded 2-core machine, never a speed claim


# Two engine runs of the stage (stopped, then resumed): past pytest's 300 s default when
# the box is loaded; a hang bound, not a speed claim.
@pytest.mark.timeout(600)
def test_a_relaunch_during_dpo_skips_sft_and_resumes_dpo_from_its_checkpoint(
    ray_local: None, tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    from stages.post_training import PostTrainingStage, PostTrainingStageConfig

    recipe = {
        **base_model(tiny_policy),
        "sft": {"data": data_ref(task_files["sft"]), "steps": 2, "learning_rate": 5e-3},
        "dpo": {
            "data": data_ref(task_files["dpo"]),
            "steps": 40,
            "learning_rate": 1e-3,
            "checkpoint_every_steps": 4,
            "gate": None,
        },
    }

    def stage() -> Any:
        return PostTrainingStage(
            PostTrainingStageConfig.model_validate(
                {
                    "recipe": recipe,
                    "output_dir": str(tmp_path / "out"),
                    "fleet": "local",
                    "data_roots": DEFAULT_ROOTS,
                    "model_roots": DEFAULT_ROOTS,
                }
            )
        )

    first: list[Any] = []
    ctx = StageContext(run_id="rl", booking_id="b", workdir=tmp_path / "w", emit=first.append)
    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.update(first=stage().run(ctx)))
    runner.start()
    wait_until(
        lambda: (
            any(isinstance(e, CheckpointEvent) and e.phase == "dpo" and e.step >= 8 for e in first)
            or not runner.is_alive()
        ),
        WAIT_S,
        "a DPO checkpoint mid-objective",
        poll_s=0.2,
    )
    pids = replica_group_pids("rl-dpo")  # the engine's run id is the objective's
    ctx.cancel_event.set()
    runner.join(WAIT_S)
    assert outcome["first"].reason == "cancelled"
    # Killed ranks may finish an async save in the moment before they exit: list the
    # checkpoints once none of the first launch's is left to write one (one host).
    assert pids
    wait_until(lambda: not any(map(_alive, pids)), WAIT_S, "the first launch's ranks exit")
    newest = list_checkpoints(tmp_path / "w" / "dpo" / "checkpoints")[-1].step
    assert 8 <= newest < 40

    again: list[Any] = []
    out = stage().run(
        StageContext(run_id="rl", booking_id="b", workdir=tmp_path / "w", emit=again.append)
    )
    assert out.status == "passed", out.reason
    steps = [e for e in again if isinstance(e, StepEvent) and e.committed]
    assert {e.phase for e in steps} == {"dpo"}  # SFT's export and numbers were kept
    assert min(e.step for e in steps) == newest + 1 and max(e.step for e in steps) == 40
    assert out.metrics["sft_steps"] == 2.0 and "sft_nll_gain" in out.metrics
    assert out.artifacts["steps"]["dpo"]["hf_model_dir"] == str(tmp_path / "out" / "dpo")
