"""How the backend tells whether the embedded head it started is still running, and
the cluster token it keeps."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.runtime.ray_cluster import _alive, ensure_auth_token, ray_environment
from stages.errors import ItoError


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
    assert ray_environment()["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"


def test_a_ray_process_gets_the_allowlisted_names_and_no_credential() -> None:
    """What the head (and through it every Ray worker) is started with, from a
    server's environment that holds the store's credentials and API keys. The real
    processes' environments are checked in test_ray_environment.py."""
    server = {
        "PATH": "/usr/bin",
        "HOME": "/home/ito",
        "OMP_NUM_THREADS": "1",
        "ITO_LAUNCH_KEY_FILE": "/var/ito/launch.key",
        "ITO_LISTEN_PORTS": "42000-42999",
        "NCCL_SOCKET_IFNAME": "ib0",
        "RAY_AUTH_MODE": "token",
        "PGPASSWORD": "canary",
        "PGPASSFILE": "/home/ito/.pgpass",
        "PGUSER": "ito",
        "ITO_DB": "postgresql://ito@db/ito",
        "ITO_DB_PASSWORD_FILE": "/run/secrets/db",
        "ITO_API_KEY": "ito_sk_canary",
        "HF_TOKEN": "hf_canary",
        "AWS_SECRET_ACCESS_KEY": "canary",
    }
    env = ray_environment(server)
    assert set(env) == {
        "PATH",
        "HOME",
        "OMP_NUM_THREADS",
        "ITO_LAUNCH_KEY_FILE",
        "ITO_LISTEN_PORTS",
        "NCCL_SOCKET_IFNAME",
        "RAY_AUTH_MODE",
        "RAY_USAGE_STATS_ENABLED",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S",
    }
    assert not any("canary" in v or "/run/secrets" in v for v in env.values())


def test_the_token_is_generated_once_and_kept_private(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = ensure_auth_token()  # none yet: `ray get-auth-token --generate` writes one
    assert path == tmp_path / ".ray" / "auth_token"
    token = path.read_bytes()
    assert len(token.strip()) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # An existing token is the cluster's: kept as it is, its mode put back to private.
    path.chmod(0o644)
    assert ensure_auth_token().read_bytes() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # A link in its place is not ours to trust.
    path.unlink()
    other = tmp_path / "elsewhere"
    other.write_text("x" * 64)
    path.symlink_to(other)
    with pytest.raises(ItoError, match="not ours"):
        ensure_auth_token()
