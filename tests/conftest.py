"""Shared test fixtures."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
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
# A `ray start --block` node that gets SIGTERM first asks its GCS to drain it (for Ray
# Serve's proxies, which nothing here runs) and waits up to 30 s for that before it
# stops its processes: every embedded head and raylet a test stops would spend those
# 30 s. 0 turns the drain off; the node's processes still get the SIGTERM and stop.
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
# One launch key for the session (never ~/.ito): checkpoint seals derive their key from
# it, so whatever process saves or loads a checkpoint in a test (this one, a Ray actor,
# a backend subprocess) shares it. Tests that need their own key set it themselves.
if "ITO_LAUNCH_KEY_FILE" not in os.environ:
    _key_dir = Path(tempfile.mkdtemp(prefix="ito-test-key-"))
    os.environ["ITO_LAUNCH_KEY_FILE"] = str(_key_dir / "launch.key")
    (_key_dir / "launch.key").touch(mode=0o600)
    (_key_dir / "launch.key").write_text(secrets.token_hex(32))
    atexit.register(shutil.rmtree, _key_dir, True)

# Property tests draw the same examples on every run, so a CI failure replays here;
# print_blob gives the failing example's reproduction decorator. A test's own
# @settings still sets its example count and deadline (hypothesis's own
# --hypothesis-profile picks another profile for a local hunt).
settings.register_profile("ito", derandomize=True, database=None, print_blob=True)
settings.load_profile("ito")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """A module's tests on the session's local Ray share one xdist group
    (helpers.xdist_groups): under ``pytest -n N`` they run on one worker, whose session
    Ray starts once, and other such modules go to other workers."""
    from helpers.xdist_groups import ray_local_group

    for item in items:
        uses_ray_local = "ray_local" in getattr(item, "fixturenames", ())
        if uses_ray_local and item.get_closest_marker("xdist_group") is None:
            item.add_marker(ray_local_group(item.module.__name__ if item.module else ""))
    yield
    # pytest-xdist 3.8 (--dist loadgroup) names a grouped test ``ID@group`` by setting
    # ``item._nodeid``, which pytest 9 no longer reads (it keeps ``item._id``): without
    # this the groups are ignored.
    for item in items:
        renamed = item.__dict__.pop("_nodeid", None)
        if isinstance(renamed, str) and renamed != item.nodeid:
            item._id = type(item._id).parse(renamed)  # type: ignore[attr-defined]


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
