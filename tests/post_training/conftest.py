"""Fixtures of post-training tests: a tiny random-init HF policy and a synthetic
verifiable task (no hub: nothing can be downloaded here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.data_prep.refs import is_data
from stages.post_training.synthetic import build_tiny_policy, write_task
from stages.snapshot import path_digest


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_task(tmp_path_factory.mktemp("task"))


def data_ref(path: Path) -> dict[str, object]:
    return {
        "uri": f"file://{path}",
        "sha256": path_digest(path, include=is_data),
        "provenance": {"source": "synthetic", "license": "MIT"},
    }


def base_model(path: Path) -> dict[str, str]:
    """A recipe's ``base_model`` and the digest that pins it."""
    return {"base_model": f"file://{path}", "base_model_sha256": path_digest(path)}
