"""Fixtures of post-training tests: a tiny random-init HF policy and a synthetic
verifiable task (no hub: nothing can be downloaded here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.post_training.synthetic import build_tiny_policy, write_task


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_task(tmp_path_factory.mktemp("task"))


def data_ref(path: Path) -> dict[str, object]:
    return {"uri": f"file://{path}", "sha256": "0" * 64,
            "provenance": {"source": "synthetic", "license": "MIT"}}
