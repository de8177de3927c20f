"""SFT and DPO are scored on the engine's evaluating rank: the driver process (this
test's) never materialises a model, and the rank's numbers are those the driver's own
copies gave (the same functions on the same folders, run here after the stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.tenants import DEFAULT_ROOTS

from stages.base import StageContext
from tests.post_training.conftest import base_model, data_ref


class _DriverLoadedAModel(AssertionError):
    pass


def _forbid_models_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load in this process (the driver's) fails the test; the trainer ranks
    are Ray actors in their own processes and are not patched."""
    import transformers

    from stages.model import lm
    from stages.post_training import hf_io

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise _DriverLoadedAModel("the driver loaded a model")

    monkeypatch.setattr(hf_io, "load_model", refuse)
    monkeypatch.setattr(lm, "load_hf_folder", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", refuse)


def test_sft_then_dpo_are_scored_on_the_rank_with_the_drivers_old_numbers(
    ray_local: None,
    tmp_path: Path,
    tiny_policy: Path,
    task_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stages.evals import run_battery
    from stages.evals.objective_battery import objective_battery, objective_gate_metrics
    from stages.evals.objective_eval import heldout_text, read_rows
    from stages.post_training import PostTrainingStage, PostTrainingStageConfig
    from stages.post_training.hf_io import load_model, load_tokenizer

    recipe = {
        **base_model(tiny_policy),
        "sft": {"data": data_ref(task_files["sft"]), "steps": 2, "learning_rate": 5e-3},
        "dpo": {
            "data": data_ref(task_files["dpo"]),
            "steps": 2,
            "learning_rate": 5e-3,
            "gate": None,
            "eval": {"battery": "smoke", "gates": [{"metric": "heldout_loss", "max": 1e9}]},
        },
    }
    stage = PostTrainingStage(
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
    events: list[Any] = []
    with monkeypatch.context() as m:
        _forbid_models_here(m)
        out = stage.run(
            StageContext(run_id="r", booking_id="b", workdir=tmp_path / "w", emit=events.append)
        )
    assert out.status == "passed", out.reason

    # The old in-driver scoring, on the same folders: the base (copied into the run's
    # inputs) before each objective, each objective's export after it.
    tok = load_tokenizer(tiny_policy)
    sft_rows, dpo_rows = read_rows(task_files["sft"]), read_rows(task_files["dpo"])
    base, sft_out = load_model(tiny_policy), load_model(tmp_path / "out" / "sft")
    dpo_out = load_model(tmp_path / "out" / "dpo")
    want = {
        **{
            f"sft_{k}": v
            for k, v in objective_gate_metrics(
                "sft",
                objective_battery("sft", base, tok, sft_rows),
                objective_battery("sft", sft_out, tok, sft_rows),
            ).items()
        },
        **{
            f"dpo_{k}": v
            for k, v in objective_gate_metrics(
                "dpo",
                objective_battery("dpo", sft_out, tok, dpo_rows),
                objective_battery("dpo", dpo_out, tok, dpo_rows),
            ).items()
        },
    }
    # Same fp32 weights, same functions, another process: equal up to float summation.
    for k, v in want.items():
        assert out.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    battery = run_battery(
        dpo_out,
        tok,
        "smoke",
        [heldout_text(tok, r) for r in dpo_rows],
        seq_len=int(dpo_out.config.max_position_embeddings),
        phase="post_training.dpo",
        work_dir=tmp_path,
    )
    got = out.artifacts["steps"]["dpo"]["battery"]
    assert got["phase"] == "post_training.dpo"
    assert {c["name"]: c["score"] for c in got["checks"]} == pytest.approx(battery.scores())
    scores = [e for e in events if getattr(e, "scope", "") == "dpo.battery"]
    assert scores and scores[0].values == pytest.approx(battery.scores())
