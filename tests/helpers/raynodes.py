"""A Ray cluster of several raylets on this one machine, each ``ray start --block`` in
its own process session with explicit ports, so a test can stop one node (SIGTERM
to its session, as Slurm's or Kubernetes' teardown would) and leave the others.

The modules on booking-marked raylets (``tests/runtime/test_booking_*_on_ray.py``,
next to each other in a run) share one head: :func:`booking_raylets`. Each module
starts the raylets it needs and stops them at its end; the last of them stops the
head (a head's start-up took 33 and 75 s on the 2-core testbed at load 12-25)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers.backend import Backend, free_port
from helpers.ray_backend import python_docs_corpus
from helpers.ray_local import note_start, start_turn
from helpers.tenants import Tenant, add_tenant_booking, make_tenant
from orchestrator.runtime import ray_cluster

NODE_START_TIMEOUT_S = 120.0
NODE_STOP_TIMEOUT_S = 30.0
# `ray start` gives its raylet a fixed 30 s to register with the GCS, which a loaded
# 2-core host can miss (the GCS then "cannot find the node"), and a port picked by
# free_port can be taken by another raylet's worker before this one binds it: a node
# that fails to start is started once more, on fresh ports.
NODE_START_ATTEMPTS = 2


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    resources: dict[str, float] = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # `ray start --block` stops its children
        try:
            self.proc.wait(NODE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(NODE_STOP_TIMEOUT_S)


@dataclass
class LocalCluster:
    tmp: Path
    head_port: int = 0
    dashboard_port: int = 0
    nodes: list[Node] = field(default_factory=list)
    ray_tmp: Path | None = None
    # Environment of every raylet (and so of the actors on it), e.g. the launch key
    # file the backend shares with its nodes (ITO_LAUNCH_KEY_FILE).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.head_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, name: str, args: list[str], resources: dict[str, float]) -> Node:
        failures: list[str] = []
        for _ in range(NODE_START_ATTEMPTS):
            node, failure = self._start_once(name, args, resources)
            if node is not None:
                return node
            failures.append(failure)
        raise RuntimeError(f"ray node {name} did not start: " + "\n---\n".join(failures))

    def _start_once(
        self, name: str, args: list[str], resources: dict[str, float]
    ) -> tuple[Node | None, str]:
        log = self.tmp / f"ray-{name}.log"
        ports = [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        cmd = [
            _ray(),
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            "--object-store-memory=200000000",
            *ports,
            *args,
        ]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        with start_turn():  # one Ray start-up at a time on this host (helpers.ray_local)
            start_at = log.stat().st_size if log.exists() else 0
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    cmd,
                    env=_env(self.env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            node = Node(name, proc, log, resources)
            deadline = time.monotonic() + NODE_START_TIMEOUT_S
            while time.monotonic() < deadline:
                text = log.read_bytes()[start_at:]
                if b"Ray runtime started" in text:
                    self.nodes.append(node)
                    return node, ""
                if proc.poll() is not None:
                    break
                time.sleep(0.25)
            node.stop()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what the failed start left running
            tail = log.read_bytes()[start_at:][-3000:].decode(errors="replace")
            return None, f"exit code {proc.returncode}: {tail}"

    def _ray_tmp(self) -> str:
        # Ray's unix sockets live under the temp dir, whose path must stay short
        # (AF_UNIX: 107 bytes), so not under pytest's tmp_path.
        if self.ray_tmp is None:
            self.ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        return str(self.ray_tmp)

    def start_head(self) -> Node:
        # The cluster's token, made only if missing (a `ray get-auth-token` process is
        # seconds of imports on a loaded host), kept private as the product keeps it.
        ray_cluster.ensure_auth_token()
        self.head_port = free_port()
        self.dashboard_port = free_port()
        note_start("cluster", str(self.tmp))
        # The head runs no work (num-cpus 0), as in deploy/k8s: runs go to booked nodes.
        return self._start(
            "head",
            [
                "--head",
                f"--port={self.head_port}",
                "--num-cpus=0",
                f"--temp-dir={self._ray_tmp()}",
                f"--ray-client-server-port={free_port()}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
            ],
            {},
        )

    def add_node(self, name: str, *, num_cpus: int, resources: dict[str, float]) -> Node:
        return self._start(
            name,
            [
                f"--address={self.address}",
                f"--num-cpus={num_cpus}",
                # 0/0: workers bind random ports (raylets share a host)
                "--min-worker-port=0",
                "--max-worker-port=0",
            ],
            resources,
        )

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        if self.ray_tmp is not None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


# The xdist group of the modules on the shared booking cluster: one worker runs them
# all, and the last of them in the session stops the head.
BOOKING_RAYLETS_GROUP = "booking-raylets"
booking_raylets_group = pytest.mark.xdist_group(BOOKING_RAYLETS_GROUP)
_shared: LocalCluster | None = None


def _on_shared_cluster(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("xdist_group")
    return mark is not None and BOOKING_RAYLETS_GROUP in mark.args


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        cluster, _shared = _shared, None
        cluster.stop()


@contextlib.contextmanager
def booking_raylets(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    raylets: dict[str, dict[str, float]],
    *,
    num_cpus: int = 2,
) -> Iterator[tuple[LocalCluster, dict[str, Node]]]:
    """The session's booking cluster (its head started by the first module that asks)
    with ``raylets`` (name -> custom resources) started for this module and stopped at
    its end. The cluster's raylets read the launch key file named in ``cluster.env``
    (``ITO_LAUNCH_KEY_FILE``): a module's server must use that one. A module using it
    carries ``booking_raylets_group``."""
    global _shared
    if _shared is None:
        tmp = tmp_path_factory.mktemp("booking-raylets")
        cluster = LocalCluster(tmp, env={"ITO_LAUNCH_KEY_FILE": str(tmp / "launch.key")})
        try:
            cluster.start_head()
        except BaseException:
            cluster.stop()
            raise
        _shared = cluster
        request.session.addfinalizer(_stop_shared)  # a session cut short
    cluster = _shared
    nodes: dict[str, Node] = {}
    try:
        for name, resources in raylets.items():
            nodes[name] = cluster.add_node(name, num_cpus=num_cpus, resources=resources)
        yield cluster, nodes
    finally:
        for node in reversed(nodes.values()):
            node.stop()
        users = [i for i in request.session.items if _on_shared_cluster(i)]
        if not users or getattr(users[-1], "module", None) is request.module:
            _stop_shared()


@contextlib.contextmanager
def server_on_cluster(
    tmp: Path, cluster: LocalCluster, bookings: list[dict[str, Any]], env: dict[str, str]
) -> Iterator[tuple[Backend, Tenant, Path]]:
    """An API server joined to ``cluster`` with ``--ray-address`` (``env`` added to its
    own), tenant ``acme`` on ``bookings`` (booking documents, stored before the server
    starts), and the corpus its runs train on; yields (server, tenant, corpus) and
    stops the server at the end. The
    server signs drivers with the launch key file the cluster's raylets were started
    with (``cluster.env``), as deploy/slurm shares it through the file system and
    deploy/k8s through a Secret."""
    be = Backend(
        db=tmp / "ito.db",
        var_dir=tmp / "var",
        log_path=tmp / "backend.log",
        env={**env, **cluster.env},
        extra_args=["--runtime", "ray", "--ray-address", cluster.address],
    )
    tenant = make_tenant(be.db, "acme", booking=bookings[0])
    for doc in bookings[1:]:
        add_tenant_booking(be.db, tenant, doc)
    corpus = python_docs_corpus(tmp / "data" / "train.jsonl", 300)
    try:
        be.start()
        yield be, tenant, corpus
    finally:
        be.stop()
