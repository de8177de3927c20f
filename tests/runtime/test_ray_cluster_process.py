"""How the backend tells whether the embedded head it started is still running."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchestrator.runtime.ray_cluster import _alive, _env


def test_an_exited_child_is_not_alive_though_it_is_still_a_zombie() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Wait for the exit without reaping it (WNOWAIT): it is a zombie, kill(pid, 0) works.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    os.kill(child.pid, 0)
    assert not _alive(child.pid)


def test_a_running_process_is_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _alive(child.pid)
        assert _alive(os.getpid())  # not a child of itself: the /proc state decides
    finally:
        child.kill()
        child.wait()


def test_the_head_is_started_without_serves_drain_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", raising=False)
    assert _env()["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
