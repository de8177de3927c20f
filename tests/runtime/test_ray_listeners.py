"""The embedded Ray head: what listens where, with which folder modes.

Starts a real head (``ray start --head`` as ``ito-backend serve`` does), lists its
listening sockets with ``ss -ltnp``, and stops it. What this build controls is
asserted; what Ray 2.60 itself binds to all interfaces is asserted as a strict xfail
so the day Ray binds it to the node address, the test says so.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.backend import free_port
from helpers.ray_local import note_start, start_turn
from helpers.tools import require
from helpers.xdist_groups import module_group

from orchestrator.runtime import ray_cluster

pytestmark = [pytest.mark.slow, module_group(__name__)]

# "Ray runtime started" comes once GCS and raylet serve; the head starts the Ray Client
# server and the dashboard agent after it, so their ports are waited for.
LATE_LISTENERS_TIMEOUT_S = 90.0


def _session_pids(leader: int) -> set[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "-s", str(leader)], capture_output=True, text=True, check=False
    ).stdout
    return {int(p) for p in out.split()}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    var_dir = tmp_path_factory.mktemp("ray-head")
    settings = ray_cluster.RaySettings(
        head_port=free_port(),
        dashboard_port=free_port(),
        client_server_port=free_port(),
        dashboard_agent_listen_port=free_port(),
        num_cpus=1,
    )
    with start_turn():
        ray_cluster.start_local_head(var_dir, settings)
    note_start("embedded-head", str(var_dir))
    try:
        yield {"var_dir": var_dir, "settings": settings}
    finally:
        ray_cluster.stop_local_head(var_dir)


@pytest.fixture(scope="module")
def listeners(head: dict[str, object]) -> list[str]:
    """``ss -ltnp`` lines of the head's processes (only these tests need ss)."""
    ss = require("ss", "ss")["ss"]
    var_dir = head["var_dir"]
    assert isinstance(var_dir, Path)
    settings = head["settings"]
    assert isinstance(settings, ray_cluster.RaySettings)
    late = {settings.client_server_port, settings.dashboard_agent_listen_port}
    deadline = time.monotonic() + LATE_LISTENERS_TIMEOUT_S
    while True:
        pids = _session_pids(int(ray_cluster.head_pid_file(var_dir).read_text()))
        lines = subprocess.run(
            [ss, "-ltnpH"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        ours = [li for li in lines if any(f"pid={p}," in li for p in pids)]
        if late <= {_local(li)[1] for li in ours} or time.monotonic() > deadline:
            return ours
        time.sleep(0.5)


def _local(line: str) -> tuple[str, int]:
    addr = line.split()[3]
    host, _, port = addr.rpartition(":")
    return host.strip("[]").removeprefix("::ffff:"), int(port)


def test_dashboard_and_client_server_listen_on_loopback(
    head: dict[str, object], listeners: list[str]
) -> None:
    settings = head["settings"]
    assert isinstance(settings, ray_cluster.RaySettings)
    bound = [_local(li) for li in listeners]
    assert bound, "no listening socket found for the head's processes"
    for port in (settings.dashboard_port,):
        hosts = {h for h, p in bound if p == port}
        assert hosts == {"127.0.0.1"}, (port, hosts)
    # The head's own ports are the ones it was given, so two heads share a host.
    for port in (settings.client_server_port, settings.dashboard_agent_listen_port):
        assert any(p == port for _, p in bound), (port, sorted(p for _, p in bound))


def test_temp_root_is_private(head: dict[str, object]) -> None:
    var_dir = head["var_dir"]
    assert isinstance(var_dir, Path)
    root = ray_cluster.ray_temp_dir(var_dir)
    st = root.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert any(p.name.startswith("session_") for p in root.iterdir())
    # Its parent, which Ray never touches, is what keeps everyone else out.
    parent = ray_cluster.ray_private_root(var_dir)
    assert root.parent == parent and stat.S_IMODE(parent.stat().st_mode) == 0o700
    token = ray_cluster.auth_token_path()  # token auth stays on, its file private
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


@pytest.mark.xfail(
    strict=True,
    reason="Ray 2.60's GCS, raylet, core-worker and dashboard "
    "agent gRPC servers bind all interfaces whatever --node-ip-address says "
    "(fixed upstream in ray-project/ray#59852); docs/runtime.md lists the "
    "ports to firewall",
)
def test_every_listener_is_loopback(listeners: list[str]) -> None:
    hosts = {_local(li)[0] for li in listeners}
    assert hosts <= {"127.0.0.1", "::1"}, hosts
