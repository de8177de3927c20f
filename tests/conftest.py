"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The store fixtures (``db``, ``engine``, ``pg_server``) for every test folder.
pytest_plugins = ["helpers.fixtures"]

# Keep torch from oversubscribing the 2 cores when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray reads its auth mode at import; every Ray in the tests keeps token auth on.
os.environ.setdefault("RAY_AUTH_MODE", "token")


@pytest.fixture
def repo_root() -> Path:
    return REPO
