"""The run's lighthouse behind its front: torchft's real Rust LighthouseServer on
loopback, the front on a non-loopback address of this host (``ITO_NODE_IP``, as a
node's cluster address), a real torchft ``LighthouseClient`` joining a quorum through
it, and the dashboard's kill route tried at the address the ranks dial."""

from __future__ import annotations

import datetime
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from helpers.tools import require

from stages.trainer.config import FaultToleranceConfig
from stages.trainer.fleet.lighthouse import LighthouseActor, rust_extension, status_text

TIMEOUT = datetime.timedelta(seconds=30)  # hang guard of one torchft call


def _host_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # the source address of the default route (a UDP connect sends nothing)
            probe.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("this host has no route off loopback to put a front on")
        return str(probe.getsockname()[0])


@pytest.fixture
def lighthouse(monkeypatch: pytest.MonkeyPatch) -> Iterator[LighthouseActor]:
    monkeypatch.setenv("ITO_NODE_IP", _host_address())
    monkeypatch.delenv("ITO_LISTEN_PORTS", raising=False)
    lh = LighthouseActor(FaultToleranceConfig())
    yield lh
    lh.shutdown()


def _kill(address: str, replica: str) -> int | str:
    req = urllib.request.Request(f"{address}/replica/{replica}/kill", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT.total_seconds()) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError) as e:
        return type(e).__name__


def test_ranks_join_through_the_front_and_the_dashboard_kill_never_reaches_the_lighthouse(
    lighthouse: LighthouseActor,
) -> None:
    addr = lighthouse.address()
    assert addr.startswith(f"http://{_host_address()}:")
    client = rust_extension().LighthouseClient(addr, connect_timeout=TIMEOUT)
    quorum = client.quorum(
        replica_id="rg0", timeout=TIMEOUT, address="m", store_address="s", step=3, world_size=1
    )
    assert [p.replica_id for p in quorum.participants] == ["rg0"]
    # The dashboard's kill at the address the ranks dial: closed by the front, unanswered.
    answer = _kill(addr, "rg0")
    assert not isinstance(answer, int), f"the kill route answered {answer}"
    client.heartbeat("rg0", timeout=TIMEOUT)
    stats = lighthouse.front_stats()
    assert stats["protocol"] == 1 and stats["admitted"] >= 1
    # SREs still read the quorum: the status page, over loopback, through the actor.
    status = lighthouse.quorum_status()
    assert "rg0" in status and "Step: 3" in status and "<" not in status


def test_the_lighthouse_listens_on_loopback_and_its_front_on_the_cluster_address(
    lighthouse: LighthouseActor,
) -> None:
    ss = require("ss", "ss")["ss"]
    port = lighthouse.served.port
    lines = subprocess.run(
        [ss, "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    local = sorted(line.split()[3] for line in lines)
    assert local == sorted([f"127.0.0.1:{port}", f"{_host_address()}:{port}"]), lines


def test_the_status_page_reads_as_lines() -> None:
    page = "<h3>Previous Quorum</h3>\n<li>rg0 &amp; friends</li><br>Step: 4"
    assert status_text(page) == "Previous Quorum\nrg0 & friends\nStep: 4"
