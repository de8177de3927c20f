"""The engine config of an SFT or DPO objective, built from the recipe and the run's train
config (the engine run itself: test_data_rewards.py, test_post_training_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.errors import ErrorCode, ItoError
from stages.post_training.config import DPOConfig
from stages.post_training.on_engine import objective_train_config
from stages.trainer.config import TrainingTarget, TrainStageConfig

_DATA = {
    "uri": "file:///d/x.jsonl",
    "sha256": "0" * 64,
    "provenance": {"source": "t", "license": "MIT"},
}


def _dpo(batch_size: int) -> DPOConfig:
    return DPOConfig.model_validate(
        {
            "data": _DATA,
            "steps": 6,
            "beta": 0.3,
            "learning_rate": 1e-4,
            "batch_size": batch_size,
            "max_length": 48,
        }
    )


def _train(groups: int) -> TrainStageConfig:
    return TrainStageConfig.model_validate(
        {
            "model": {"preset": "llama-tiny", "size": "tiny"},
            "target": {"max_steps": 2, "seq_len": 32, "global_batch_tokens": 128},
            "checkpoint": {"interval_steps": 10, "storage_uri": "file:///tmp/c"},
            "replica_groups": groups,
            "device": "cuda",
            "fault_tolerance": {"heartbeat_timeout_ms": 2000},
        }
    )


def test_a_dpo_objective_trains_the_recipe_on_the_runs_replica_groups(tmp_path: Path) -> None:
    cfg = objective_train_config(
        "dpo",
        _dpo(4),
        base=tmp_path / "base",
        data_path=tmp_path / "dpo.jsonl",
        checkpoint_dir=tmp_path / "ck",
        train=_train(2),
        device="cpu",
    )
    assert cfg.objective.kind == "dpo" and cfg.objective.beta == 0.3
    assert cfg.objective.data_path == str(tmp_path / "dpo.jsonl")
    assert (cfg.objective.batch_size, cfg.objective.max_length) == (4, 48)
    assert cfg.model.checkpoint_path == str(tmp_path / "base")
    assert cfg.replica_groups == 2 and cfg.device == "cuda"
    assert cfg.fault_tolerance.heartbeat_timeout_ms == 2000
    assert cfg.micro_batch == 2  # 4 pairs over 2 groups
    (phase,) = cfg.schedule.phases
    assert (phase.name, phase.end_step, phase.seq_len) == ("dpo", 6, 48)
    # The recipe's LR, constant from the first step to the last (no warmup, no decay).
    assert {phase.lr(s) for s in range(6)} == {1e-4}
    assert cfg.checkpoint.storage_path == str((tmp_path / "ck").resolve())
    assert not cfg.loss_spike.enabled


def test_without_a_train_config_one_group_on_the_stage_device(tmp_path: Path) -> None:
    cfg = objective_train_config(
        "dpo",
        _dpo(3),
        base=tmp_path,
        data_path=tmp_path / "d.jsonl",
        checkpoint_dir=tmp_path,
        train=None,
        device="cpu",
    )
    assert cfg.replica_groups == 1 and cfg.device == "cpu" and cfg.micro_batch == 3


def test_a_batch_the_groups_cannot_split_is_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ItoError) as e:
        objective_train_config(
            "dpo",
            _dpo(3),
            base=tmp_path,
            data_path=tmp_path / "d.jsonl",
            checkpoint_dir=tmp_path,
            train=_train(2),
            device="cpu",
        )
    assert e.value.code is ErrorCode.manifest_invalid
    assert "does not split" in e.value.message


def test_sft_and_dpo_objectives_use_trls_adamw_betas_and_the_recipes_checkpoint_interval(
    tmp_path: Path,
) -> None:
    import dataclasses

    from transformers import TrainingArguments

    trl_defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}

    def config(dpo: DPOConfig) -> TrainStageConfig:
        return objective_train_config(
            "dpo",
            dpo,
            base=tmp_path,
            data_path=tmp_path / "d.jsonl",
            checkpoint_dir=tmp_path,
            train=None,
            device="cpu",
        )

    cfg = config(_dpo(2))
    assert cfg.target.adam_betas == (trl_defaults["adam_beta1"], trl_defaults["adam_beta2"])
    assert cfg.target.weight_decay == trl_defaults["weight_decay"]
    # Pretraining keeps its own betas; a recipe may set others.
    assert TrainingTarget(max_steps=1, seq_len=8, global_batch_tokens=8).adam_betas == (0.9, 0.95)
    tuned = _dpo(2).model_copy(update={"adam_betas": (0.8, 0.99), "checkpoint_every_steps": 2})
    cfg = config(tuned)
    assert cfg.target.adam_betas == (0.8, 0.99)
    assert cfg.checkpoint.interval_steps == 2 and cfg.checkpoint.keep == 2
    # Without an interval only the objective's closing checkpoint is written.
    assert config(_dpo(2)).checkpoint.interval_steps == 6
    with pytest.raises(ValueError):
        DPOConfig.model_validate({**_dpo(2).model_dump(), "adam_betas": (0.9, 1.0)})
