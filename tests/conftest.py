"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Keep torch from oversubscribing the 2 cores when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def repo_root() -> Path:
    return REPO
