"""Shared test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]
# The store fixtures (``db``, ``engine``, ``pg_server``) for every test folder.
pytest_plugins = ["helpers.fixtures"]

# Keep torch from oversubscribing the 2 cores when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray reads its auth mode at import; every Ray in the tests keeps token auth on.
os.environ.setdefault("RAY_AUTH_MODE", "token")

# Property tests draw the same examples on every run, so a CI failure replays here;
# print_blob gives the failing example's reproduction decorator. A test's own
# @settings still sets its example count and deadline (hypothesis's own
# --hypothesis-profile picks another profile for a local hunt).
settings.register_profile("ito", derandomize=True, database=None, print_blob=True)
settings.load_profile("ito")


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray for every test that uses Ray in this process (helpers.ray_local)."""
    from helpers import ray_local as local

    temp = local.start()
    try:
        yield
    finally:
        local.stop(temp)
