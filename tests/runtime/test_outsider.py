"""A run only its own processes can touch: an outsider on the cluster network, with no
secret, attacks a real run and no replica group is lost.

Nothing is mocked: a local Ray of the run's own (its node address the host side of a
veth pair, ``tests/helpers/outsider.py``), torchft's Rust lighthouse and Managers, two
replica groups training llama-tiny. While they train, from a network namespace at
198.51.100.2 (none of the run's addresses): every TCP port the run's processes listen
on (``ss -ltnp``, the pids of the run's Ray actors and its driver; Ray's own
core-worker server excluded, it is Ray's and token-authenticated) is connected to, sent
the lighthouse dashboard's ``POST /replica/<id>/kill`` for each live replica and an
HTTP/2 preface; a fake quorum join and a fake heartbeat go to the lighthouse's address
through torchft's own client. Then: no listener of the run on a wildcard address, none
answered, and the run trained to its end with both groups in every quorum.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.outsider import HOST_IP, WILDCARDS, Outsider, outsider_network
from helpers.tools import require
from pydantic import TypeAdapter

from stages.events import Event, FleetEvent, InterruptionEvent, StepEvent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"
_EVENT = TypeAdapter(Event)
# Hang guards, never speed claims.
START_TIMEOUT_S = 300.0
FINISH_TIMEOUT_S = 480.0
STEPS_BEFORE_PROBES = 10


class Run:
    """The run's child process and what it writes (tests/helpers/outsider_run.py)."""

    def __init__(self, workdir: Path, run_id: str):
        self.workdir = workdir
        env = {**os.environ, "ITO_NODE_IP": HOST_IP}
        env.pop("ITO_LISTEN_PORTS", None)
        self.log = (workdir / "child.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPERS / "outsider_run.py"), str(workdir), run_id, HOST_IP],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def events(self) -> list[Any]:
        path = self.workdir / "events.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [_EVENT.validate_json(li) for li in lines if li.endswith("}")]

    def tail(self) -> str:
        return (self.workdir / "child.log").read_text()[-4000:]

    def wait(self, cond: Any, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = cond()
            if got:
                return got
            assert self.proc.poll() is None or cond(), f"the run ended before {what}\n{self.tail()}"
            assert time.monotonic() < deadline, (
                f"not within {timeout_s:.0f} s: {what}\n{self.tail()}"
            )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


@pytest.fixture
def outsider() -> Iterator[Outsider]:
    with outsider_network() as out:
        yield out


def _listeners(ss: str, pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, bound address, port) of every TCP listener of ``pids``."""
    out = subprocess.run([ss, "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        for pid in {int(p) for p in re.findall(r"pid=(\d+),", line)} & pids:
            found.append((pid, host.strip("[]").removeprefix("::ffff:"), int(port)))
    return found


def _replica_ids(lighthouse_port: int) -> list[str]:
    """The live replicas' ids, as an SRE on the lighthouse's node reads them (loopback)."""
    url = f"http://127.0.0.1:{lighthouse_port}/status"
    with urllib.request.urlopen(url, timeout=10) as r:
        page = r.read().decode()
    return sorted(set(re.findall(r"(rg\d{3}[^\s<:]*(?::[0-9a-f-]+)?)", page)))


def _answered(probe: dict[str, Any]) -> bool:
    """Whether a server spoke HTTP back: an HTTP/1 status line, or an HTTP/2 frame (a
    server's first frame is its SETTINGS: a length that is a multiple of 6, type 0x4,
    flags 0 or ACK, stream 0). A listener that proves the run's secret sends 32 random
    bytes first (its challenge): one in 256 of them has 0x4 at byte 3, so the type alone
    would call a challenge an answer."""
    answer = probe["answer"].encode("latin-1")
    if answer.startswith(b"HTTP/"):
        return True
    if len(answer) < 9:
        return False
    length = int.from_bytes(answer[:3], "big")
    return answer[3] == 4 and answer[4] in (0, 1) and answer[5:9] == bytes(4) and length % 6 == 0


def test_an_outsider_reaches_no_listener_of_the_run_and_no_group_is_lost(
    outsider: Outsider, tmp_path: Path
) -> None:
    ss = require("ss", "ss")["ss"]
    run = Run(tmp_path, "outsider")
    try:
        started = run.wait(
            lambda: next(
                (
                    e
                    for e in run.events()
                    if isinstance(e, FleetEvent) and e.action == "lighthouse_started"
                ),
                None,
            ),
            START_TIMEOUT_S,
            "the lighthouse",
        )
        run.wait(
            lambda: any(
                isinstance(e, StepEvent)
                and e.committed
                and e.quorum_size == 2
                and e.step >= STEPS_BEFORE_PROBES
                for e in run.events()
            ),
            START_TIMEOUT_S,
            f"{STEPS_BEFORE_PROBES} steps with both groups",
        )
        table = json.loads((tmp_path / "ray_ports.json").read_text())
        ray_ports = {int(pid): set(ports) for pid, ports in table["ray_ports"].items()}
        listeners = _listeners(ss, set(ray_ports))
        ours = [(pid, h, p) for pid, h, p in listeners if p not in ray_ports[pid]]
        lighthouse = str(started.address)
        lh_port = int(lighthouse.rsplit(":", 1)[1])
        replicas = _replica_ids(lh_port)
        assert replicas, "no live replica on the lighthouse's status page"

        # What the outsider can dial: every run listener not on loopback (a wildcard
        # one at the run's cluster address), and the lighthouse's address.
        targets = sorted(
            {(HOST_IP if h in WILDCARDS else h, p) for _, h, p in ours if not h.startswith("127.")}
            | {(lighthouse.removeprefix("http://").rsplit(":", 1)[0], lh_port)}
        )
        probe = outsider.run(
            sys.executable,
            str(HELPERS / "outsider_probe.py"),
            stdin_text=json.dumps(
                {"targets": targets, "lighthouse": lighthouse, "replicas": replicas}
            ),
        )
        assert probe.returncode == 0, probe.stderr[-3000:]
        report = json.loads(probe.stdout.strip().splitlines()[-1])
        probed_at_step = max(e.step for e in run.events() if isinstance(e, StepEvent))

        outcome_path = tmp_path / "outcome.json"
        run.wait(outcome_path.exists, FINISH_TIMEOUT_S, "the run's end")
        outcome = json.loads(outcome_path.read_text())
        events = run.events()
    finally:
        run.stop()

    listing = "\n".join(f"pid {pid} {h}:{p}" for pid, h, p in sorted(ours))
    summary = json.dumps(report, indent=1)[-6000:]
    # What was probed and what came back, kept with the test's files for a reader.
    (tmp_path / "probes.json").write_text(
        json.dumps({"listeners": ours, "replicas": replicas, "report": report}, indent=1)
    )
    # The network path is real: the outsider reached the lighthouse's front (and was
    # closed there), so every "not answered" below is the run's doing.
    lh_probe = next(t for t in report["targets"] if t["target"][1] == lh_port)
    assert lh_probe["http2"]["connected"], summary
    # No listener of the run on a wildcard address.
    assert not [li for li in ours if li[1] in WILDCARDS], f"wildcard listeners:\n{listing}"
    # None of them answered the outsider, the dashboard's kill least of all.
    answered = [
        t["target"]
        for t in report["targets"]
        if any(_answered(k) for k in [*t["kill"], t["http2"]])
    ]
    assert not answered, f"answered the outsider: {answered}\n{listing}\n{summary}"
    assert not report["lighthouse"]["quorum"].startswith("JOINED"), summary
    assert not report["lighthouse"].get("heartbeat", "").startswith("ACCEPTED"), summary
    # And the run: to its end, no interruption, both groups in every quorum.
    assert outcome["status"] == "passed", outcome
    assert not [e for e in events if isinstance(e, InterruptionEvent)]
    committed = [e for e in events if isinstance(e, StepEvent) and e.committed]
    assert {e.quorum_size for e in committed} == {2}, sorted({e.quorum_size for e in committed})
    assert max(e.step for e in committed) > probed_at_step, "the run ended before the probes"
