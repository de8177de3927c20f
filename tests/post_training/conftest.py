"""Fixtures of post-training tests: a tiny random-init HF policy and a synthetic
verifiable task (no hub: nothing can be downloaded here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.objective_runs import (
    ReferenceRun,
    final_weights,
    objective_config,
    sft_rows,
    train_on_engine,
)

from stages.data_prep.refs import is_data
from stages.post_training.synthetic import build_tiny_policy, write_task
from stages.snapshot import path_digest


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="session")
def sft_one_rank(
    ray_local: None, tiny_policy: Path, tmp_path_factory: pytest.TempPathFactory
) -> ReferenceRun:
    """SFT on one rank with the whole global batch (test_objective_engine.py's rows and
    config): the update that two learner groups (test_objective_engine.py) and two FSDP
    ranks (test_objectives_fsdp.py) must make. Trained once a session: both compare
    with the same run."""
    tmp = tmp_path_factory.mktemp("sft-one-rank")
    cfg = objective_config(tmp, tiny_policy, sft_rows(tmp / "sft.jsonl"), groups=1)
    result, events = train_on_engine(cfg, tmp, "sft-one")
    assert result.final_checkpoint
    return ReferenceRun(cfg, result, events, final_weights(cfg, result.final_checkpoint))


def data_ref(path: Path) -> dict[str, object]:
    return {
        "uri": f"file://{path}",
        "sha256": path_digest(path, include=is_data),
        "provenance": {"source": "synthetic", "license": "MIT"},
    }


def base_model(path: Path) -> dict[str, str]:
    """A recipe's ``base_model`` and the digest that pins it."""
    return {"base_model": f"file://{path}", "base_model_sha256": path_digest(path)}


def learner_layout(tmp_path: Path, *, replica_groups: int, **pacing: Any) -> Any:
    """A run's train config for post-training's learners: only its layout counts
    (replica groups, device, timeouts, ``pacing``); each objective builds the rest."""
    from stages.checkpointing.config import CheckpointPolicy
    from stages.trainer.config import ModelSpec, TrainingTarget, TrainStageConfig

    return TrainStageConfig(
        model=ModelSpec(preset="llama-tiny", size="tiny"),
        target=TrainingTarget(max_steps=1, seq_len=32, global_batch_tokens=256),
        checkpoint=CheckpointPolicy(interval_steps=100, storage_uri=f"file://{tmp_path}/unused"),
        replica_groups=replica_groups,
        **pacing,
    )
