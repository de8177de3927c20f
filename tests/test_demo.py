"""The demo's post-training: its manifest passes the API's own recipe validation (data
inside the tenant's data root, digests matching, no base model: pretraining's export),
and the gate lines it prints follow the run's verdict; its ladder probe decides on the
demo's data at a small share of the run's pretraining. The demo itself runs in
``bash scripts/demo.sh``; this checks its parts without Ray."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from orchestrator.demo import post_training_gate_lines
from orchestrator.demo_manifest import (
    post_training_recipe,
    write_data,
    write_manifest,
    write_post_training_data,
)
from orchestrator.gates.manifest import Manifest
from stages.base import StageContext
from stages.data_prep import DataPrepStage
from stages.errors import ErrorCode, ItoError
from stages.post_training.stage import validate_recipe
from stages.presets import load_model_preset


@pytest.fixture
def demo_manifest(tmp_path: Path) -> tuple[Manifest, Path]:
    data = tmp_path / "data"
    baseline, custom = write_data(data, random.Random(0))
    recipe = post_training_recipe(
        write_post_training_data(data / "post_training", random.Random(0))
    )
    path = tmp_path / "manifest.json"
    write_manifest(path, baseline, custom, tmp_path / "checkpoints", recipe)
    return Manifest.model_validate_json(path.read_bytes()), data


def test_the_demo_recipe_is_sft_dpo_rlvr_from_pretrainings_export(
    demo_manifest: tuple[Manifest, Path],
) -> None:
    m, data = demo_manifest
    pt = m.post_training
    assert pt.objectives() == ["sft", "dpo", "rlvr"]
    assert pt.base_model is None  # SFT starts from the last phase's HF export
    assert all(getattr(pt, s).gate is not None for s in pt.objectives())
    rows = validate_recipe(pt, data_roots=[str(data)], model_roots=[])
    assert rows["sft"] == rows["dpo"] > rows["rlvr"] > 0


def test_the_demo_recipe_is_refused_outside_the_data_root(
    demo_manifest: tuple[Manifest, Path], tmp_path: Path
) -> None:
    m, _ = demo_manifest
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(ItoError) as e:
        validate_recipe(m.post_training, data_roots=[str(elsewhere)], model_roots=[])
    assert e.value.code == ErrorCode.path_outside_root


def test_the_demo_probe_decides_at_a_small_share_of_the_run(
    demo_manifest: tuple[Manifest, Path], tmp_path: Path
) -> None:
    """The demo's data prep, run alone (its proxies in this process): the probe sized to
    the run it gates still tells the in-domain custom data apart from the baseline."""
    m, data = demo_manifest
    ctx = StageContext(run_id="run-demo", booking_id="bk-demo", workdir=tmp_path / "work")
    outcome = DataPrepStage(m.data, data_roots=[str(data)]).run(ctx)
    assert outcome.passed, outcome.reason
    probe = outcome.artifacts["ladder"]
    assert probe["decision"] == "adopt", probe["stats"]
    # All proxies together (params x tokens, the compute's measure) against pretraining:
    # 2.3% (4.7% with the earlier proxies of 60k tokens at 128 bytes).
    proxies = len(probe["seeds"]) * 2 * probe["params"] * probe["tokens_per_run"]
    run = load_model_preset(m.model.preset).num_params * (
        m.training.max_steps * m.training.global_batch_tokens
    )
    assert proxies <= 0.025 * run, (proxies, run)


def _run(status: str, metrics: dict[str, float], reason: str = "") -> dict[str, Any]:
    return {
        "stage_gates": [
            {"stage": "train", "status": "passed", "reason": "", "metrics": {}},
            {"stage": "post_training", "status": status, "reason": reason, "metrics": metrics},
        ]
    }


def test_gate_lines_show_each_objectives_metric_and_bound(
    demo_manifest: tuple[Manifest, Path],
) -> None:
    recipe = demo_manifest[0].post_training
    metrics = {
        "sft_nll_gain": 2.28,
        "sft_nll_before": 3.44,
        "sft_nll_after": 1.16,
        "dpo_margin_gain": 4.17,
        "rlvr_reward_gain": 0.22,
        "rlvr_reward_first": 0.14,
        "rlvr_reward_last": 0.36,
    }
    lines = post_training_gate_lines(_run("passed", metrics), recipe)
    assert lines == [
        "gate post_training.sft (objective 1 of 3): PASSED: nll_gain=2.28 min=0.5"
        " (nll_before=3.44, nll_after=1.16)",
        "gate post_training.dpo (objective 2 of 3): PASSED: margin_gain=4.17 min=0.5",
        "gate post_training.rlvr (objective 3 of 3): PASSED: reward_gain=0.22 min=0.1"
        " (reward_first=0.14, reward_last=0.36)",
    ]


def test_a_failed_objective_is_the_last_that_ran_and_later_ones_did_not_run(
    demo_manifest: tuple[Manifest, Path],
) -> None:
    recipe = demo_manifest[0].post_training
    run = _run(
        "failed",
        {"sft_nll_gain": 1.0, "dpo_margin_gain": -0.3},
        reason="dpo: margin_gain = -0.3 < 0.5",
    )
    lines = post_training_gate_lines(run, recipe)
    assert [line.split(": ")[1] for line in lines[:3]] == ["PASSED", "FAILED", "NOT RUN"]
    assert lines[3] == "post_training failed: dpo: margin_gain = -0.3 < 0.5"


def test_no_post_training_gate_no_lines(demo_manifest: tuple[Manifest, Path]) -> None:
    recipe = demo_manifest[0].post_training
    assert post_training_gate_lines({"stage_gates": []}, recipe) == []
