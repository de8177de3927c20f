"""A throttled link between two "nodes" on one host, for benchmarks (root, tc netem).

Two network namespaces, each a node: ``a`` and ``b``. Each reaches the host (the Ray
head, the driver) over its own veth pair at full speed; ``a`` and ``b`` reach each
other only over a third veth pair whose two ends carry a ``tc netem`` qdisc (rate and
one-way delay). A node's address is the one on its host link (what Ray registers);
the routes between the nodes name it as their source, so a peer sees the address it
knows (the run's fronts admit only its nodes' addresses). Nothing on the host's own
interfaces (``lo``, where other Ray clusters of the machine talk) is touched: only
traffic between the two nodes crosses the throttled pair.

The namespaces, and with them every interface and qdisc, are deleted on ``close``
(also at exit and on SIGTERM). Not a script: ``benchmarks/slow_fabric.py`` uses it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.runtime import ray_cluster

# One ip/tc command: they act at once, a hang is a broken host.
IP_TIMEOUT_S = 10.0
# The probe's server has this long to start listening in its namespace.
PROBE_START_TIMEOUT_S = 20.0
# Round trips timed by the probe (median reported) and bytes it streams one way.
PROBE_PINGS = 20
PROBE_BYTES = 4 << 20
# tbf's queue, when netem is missing: deep enough that a TCP window never overflows it.
TBF_QUEUE_MS = 200


def unavailable_reason() -> str | None:
    """Why this host cannot make the link (None: it can): it needs root, ``ip``, ``tc``
    and the kernel's netem qdisc."""
    if sys.platform != "linux":
        return f"network namespaces and tc netem need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "tc netem and network namespaces need root (run as root to throttle)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass
class Probe:
    """What a TCP probe between two addresses measured."""

    src: str
    dst: str
    rtt_ms: float  # median round trip of a 1-byte ping-pong
    mbit_s: float  # one-way stream of PROBE_BYTES, until the receiver's ack

    def line(self) -> str:
        return f"{self.src} -> {self.dst}: rtt {self.rtt_ms:.2f} ms, {self.mbit_s:.0f} Mbit/s"


_PROBE_SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 0)); s.listen(1)
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        op = c.recv(1)
        if not op or op == b"q":
            break
        if op == b"p":
            c.sendall(b"p")
        elif op == b"s":
            left = int.from_bytes(c.recv(8), "big")
            while left > 0:
                left -= len(c.recv(min(left, 1 << 20)))
            c.sendall(b"k")
    """
)


def probe(src: str, dst: str, *, src_ns: str | None = None, dst_ns: str | None = None) -> Probe:
    """Round trip and one-way throughput of TCP from ``src`` to ``dst`` (each in its
    namespace, or the host's), by two small Python processes."""
    in_ns = lambda ns: ["ip", "netns", "exec", ns] if ns else []  # noqa: E731
    server = subprocess.Popen(
        [*in_ns(dst_ns), sys.executable, "-c", _PROBE_SERVER, dst],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = textwrap.dedent(
            f"""
            import socket, statistics, time
            c = socket.create_connection(({dst!r}, {port}), timeout={PROBE_START_TIMEOUT_S})
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range({PROBE_PINGS}):
                t = time.perf_counter(); c.sendall(b"p"); c.recv(1)
                rtts.append(time.perf_counter() - t)
            n = {PROBE_BYTES}; buf = b"x" * (1 << 20)
            t = time.perf_counter(); c.sendall(b"s" + n.to_bytes(8, "big"))
            for _ in range(n // len(buf)):
                c.sendall(buf)
            c.recv(1); dt = time.perf_counter() - t
            c.sendall(b"q")
            print(statistics.median(rtts) * 1e3, n * 8 / dt / 1e6)
            """
        )
        src_args = [*in_ns(src_ns), sys.executable, "-c", client]
        out = subprocess.run(src_args, capture_output=True, text=True, timeout=120, check=True)
        rtt, mbit = (float(x) for x in out.stdout.split())
        return Probe(src=src, dst=dst, rtt_ms=rtt, mbit_s=mbit)
    finally:
        server.kill()
        server.wait()


# The reaper: a process that outlives the benchmark's, so that a SIGKILLed benchmark
# (or one whose SIGTERM Ray's own handler turned into an abort, skipping Python's
# ``finally`` and ``atexit``) still leaves no namespace, veth or raylet behind. It reads
# lines from the benchmark on stdin ("pgid N": a raylet's session; "ns NAME": a
# namespace; "dir PATH": a scratch folder; "done": all were cleaned up already) and,
# at EOF without "done", stops every session and deletes every namespace and folder.
_REAPER = textwrap.dedent(
    """
    import os, shutil, signal, subprocess, sys, time
    noted = {"pgid": [], "ns": [], "dir": []}
    for line in sys.stdin:
        kind, _, value = line.strip().partition(" ")
        if kind == "done":
            sys.exit(0)
        noted[kind].append(value)
    pgids, names = noted["pgid"], noted["ns"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in pgids:
            try:
                os.killpg(int(g), sig)
            except OSError:
                pass
        time.sleep(5)
    for n in names:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    for d in noted["dir"]:
        shutil.rmtree(d, ignore_errors=True)
    """
)


class Reaper:
    """Cleans up after the benchmark's process however it ends (see ``_REAPER``)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _REAPER],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a signal to the benchmark's group spares it
        )

    def note(self, kind: str, value: str | int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{kind} {value}\n")
        self.proc.stdin.flush()

    def done(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.note("done", "")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        self.proc.wait(IP_TIMEOUT_S)


@dataclass
class NetemLink:
    """Two namespaced nodes, a throttled link between them; see the module docstring."""

    rate_mbit: float
    delay_ms: float  # one way, each direction
    # 10.<octet>.{1,2}.0/24: host links of a and b. Derived from the pid so two runs
    # on one host do not collide.
    octet: int = field(default_factory=lambda: 200 + os.getpid() % 50)
    tag: str = field(default_factory=lambda: f"sf{os.getpid() % 100000}")
    up: bool = False
    shaper: str = ""
    reaper: Reaper | None = None

    def ns(self, side: str) -> str:
        return f"ito{self.tag}{side}"

    def address(self, side: str) -> str:
        return f"10.{self.octet}.{1 if side == 'a' else 2}.2"

    def host_address(self, side: str) -> str:
        """The host's end of ``side``'s host link (the Ray head binds the ``a`` one)."""
        return f"10.{self.octet}.{1 if side == 'a' else 2}.1"

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(side)]

    def open(self) -> None:
        atexit.register(self.close)
        self.reaper = Reaper()
        for side in ("a", "b"):
            self.reaper.note("ns", self.ns(side))
        self.up = True
        for side in ("a", "b"):
            ns, host_if, node_if = self.ns(side), f"h{self.tag}{side}", f"n{self.tag}{side}"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if)
            _run("ip", "link", "set", node_if, "netns", ns)
            _run("ip", "addr", "add", f"{self.host_address(side)}/24", "dev", host_if)
            _run("ip", "link", "set", host_if, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(side)}/24", "dev", node_if)
            _run("ip", "-n", ns, "link", "set", node_if, "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", self.host_address(side))
        # The throttled pair: no addresses of its own, a /32 route to the other node
        # with this node's address as the source.
        xa, xb = f"x{self.tag}a", f"x{self.tag}b"
        _run(
            "ip", "link", "add", xa, "netns", self.ns("a"),
            "type", "veth", "peer", "name", xb, "netns", self.ns("b"),
        )  # fmt: skip
        for side, dev, other in (("a", xa, "b"), ("b", xb, "a")):
            ns = self.ns(side)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run(
                "ip", "-n", ns, "route", "add", f"{self.address(other)}/32",
                "dev", dev, "src", self.address(side),
            )  # fmt: skip
            self.shaper = self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> str:
        """Rate and delay on ``dev``'s egress with netem; where the kernel has no netem
        (``CONFIG_NET_SCH_NETEM`` unset), the rate alone with a token bucket (tbf) and
        the link's own latency. Returns what shapes it."""
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        # Queue at least two bandwidth-delay products (in 1500-byte packets): netem
        # drops beyond its limit, which would measure loss, not a slow link.
        bdp_packets = self.rate_mbit * 1e6 / 8 * max(self.delay_ms, 1.0) * 2e-3 / 1500
        limit = str(max(1000, int(4 * bdp_packets)))
        rate = f"{self.rate_mbit}mbit"
        netem = _run(*tc, "netem", "delay", f"{self.delay_ms}ms", "rate", rate, "limit", limit,
                     check=False)  # fmt: skip
        if netem.returncode == 0:
            return "netem"
        # A burst of one 64 KiB GSO segment (veth sends them whole), a queue that holds
        # TBF_QUEUE_S of traffic at the rate (TCP's window keeps it far below).
        _run(*tc, "tbf", "rate", rate, "burst", "64kb", "latency", f"{TBF_QUEUE_MS}ms")
        return f"tbf (no netem: {netem.stderr.strip()[:80]})"

    def shaped_bytes(self) -> int:
        """Bytes the two shaped ends have sent so far (both directions)."""
        total = 0
        for side in ("a", "b"):
            dev = f"x{self.tag}{side}"
            shown = _run(
                "ip", "netns", "exec", self.ns(side), "tc", "-s", "qdisc", "show", "dev", dev
            )
            words = shown.stdout.split()
            total += int(words[words.index("Sent") + 1])
        return total

    def close(self) -> None:
        if not self.up:
            return
        self.up = False
        for side in ("a", "b"):
            # Deleting a namespace deletes its veths, their host ends and their qdiscs.
            with contextlib.suppress(Exception):
                _run("ip", "netns", "del", self.ns(side), check=False)
        for side in ("a", "b"):  # a host end left behind by a half-made link
            with contextlib.suppress(Exception):
                _run("ip", "link", "del", f"h{self.tag}{side}", check=False)
        if self.reaper is not None:
            self.reaper.done()

    def probes(self) -> dict[str, Probe]:
        """The throttled link both ways, a node's host link, and loopback (untouched)."""
        a, b = self.address("a"), self.address("b")
        return {
            "a_to_b": probe(a, b, src_ns=self.ns("a"), dst_ns=self.ns("b")),
            "b_to_a": probe(b, a, src_ns=self.ns("b"), dst_ns=self.ns("a")),
            "host_to_b": probe(self.host_address("b"), b, dst_ns=self.ns("b")),
            "loopback": probe("127.0.0.2", "127.0.0.3"),
        }


# --- a Ray cluster whose two worker nodes are the link's two ends -----------------------
# `ray start` of one node: its raylet registers with the GCS within Ray's own 30 s; a
# loaded host takes longer to print that it is up.
NODE_START_TIMEOUT_S = 120.0
NODE_STOP_TIMEOUT_S = 30.0
# The custom resource each of the two worker nodes carries (one unit), which the run's
# placement group reserves: one bundle per node.
NODE_RESOURCE = "slow_fabric_node"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

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
class TwoNodeRay:
    """A head on the host (no CPUs: the driver's node) and one worker node in each of
    ``link``'s namespaces, ``cpus`` logical CPUs and one ``NODE_RESOURCE`` each."""

    link: NetemLink
    tmp: Path
    cpus: int = 1
    nodes: list[RayNode] = field(default_factory=list)
    port: int = 0

    @property
    def address(self) -> str:
        return f"{self.link.host_address('a')}:{self.port}"

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            # A stopped node would first wait up to 30 s for its GCS to drain it (for
            # Ray Serve, which nothing here runs); the backend's own Ray skips it too.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        }

    def _start(self, name: str, prefix: list[str], args: list[str]) -> RayNode:
        ray = str(Path(sys.executable).with_name("ray"))
        log = self.tmp / f"ray-{name}.log"
        cmd = [
            *prefix, ray, "start", "--block", "--disable-usage-stats",
            "--object-store-memory=200000000", "--min-worker-port=0", "--max-worker-port=0",
            *args,
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                env=self._env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        node = RayNode(name, proc, log)
        self.nodes.append(node)
        if self.link.reaper is not None:
            self.link.reaper.note("pgid", proc.pid)
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while b"Ray runtime started" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {name} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.25)
        return node

    def start(self) -> None:
        # The cluster's token, made only if missing: a `ray get-auth-token` process is
        # seconds of imports on a loaded host. The nodes start one at a time: a starting
        # raylet has Ray's fixed 30 s to register with its GCS, which two starting
        # together on a loaded 2-core host can both miss.
        ray_cluster.ensure_auth_token()
        self.port = free_port()
        host_ports = [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]
        self._start(
            "head",
            [],
            [
                "--head",
                f"--node-ip-address={self.link.host_address('a')}",
                f"--port={self.port}",
                "--num-cpus=0",
                "--include-dashboard=false",
                f"--temp-dir={self.tmp / 'ray'}",
                *host_ports,
            ],
        )
        for side in ("a", "b"):  # each in its own namespace: its own ports
            self._start(
                side,
                self.link.exec_prefix(side),
                [
                    f"--address={self.address}",
                    f"--node-ip-address={self.link.address(side)}",
                    f"--num-cpus={self.cpus}",
                    f"--resources={json.dumps({NODE_RESOURCE: 1})}",
                ],
            )

    def stop(self) -> None:
        for node in reversed(self.nodes):
            with contextlib.suppress(Exception):
                node.stop()
        self.nodes.clear()
