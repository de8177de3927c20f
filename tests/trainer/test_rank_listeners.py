"""Every listener a trainer rank opens stands on the node's cluster address (never a
wildcard), and an outsider on the cluster network reads no key of a group's store.

Real Ray actors (one replica group of two ranks: rank 0 hosts the group's store and
ManagerServer, every rank a heal server), torchft's lighthouse and Managers, gloo.
The rank processes' listening sockets are read with ``ss`` while they train; Ray's
own core-worker server (Ray's, token-authenticated) is left out. The outsider is a
process in a network namespace at an address that is none of the run's nodes
(``tests/helpers/outsider.py``; needs root and ``ip``), with a torch ``TCPStore``
client, the one torchft's ranks use.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.outsider import WILDCARDS, Outsider, outsider_network
from helpers.tools import require

from stages.events import StepEvent
from stages.trainer.config import TrainingTarget
from stages.trainer.parallel.layout import ParallelLayout
from stages.trainer.rank.replica import trainer_prefix
from tests.trainer.test_ft_recovery import Run, _config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# A hang guard for the run's own store client, never a speed claim.
PROBE_TIMEOUT = datetime.timedelta(seconds=60)
# Run inside the outsider's namespace: what a plain TCP connection and a torch TCPStore
# client get from the store. The plain connection sends nothing and reads: the store
# (or a front before it) either closes it unanswered ("closed", at once) or waits for
# a request ("open": the read's hang guard, 30 s, runs out). A TCPStore client retries
# a refused connection until its timeout whatever the refusal, so its bound is all
# the probe waits when refused; the namespace has no resolver and the client's reverse
# lookup of its own address takes ~5 s there, so 10 s.
STORE_PROBE = """
import datetime, json, socket, sys
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
out = {}
try:  # the network path is there: a plain TCP connect
    c = socket.create_connection((host, port), timeout=10)
    out["connected"] = True
except OSError as e:
    out["connected"] = False
else:
    with c:
        c.settimeout(30)
        try:
            out["answer"] = "closed" if c.recv(1) == b"" else "answered"
        except socket.timeout:
            out["answer"] = "open"
        except OSError:  # reset: closed unanswered too
            out["answer"] = "closed"
try:
    s = TCPStore(host, port, is_master=False, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=10))
    out["keys"] = s.list_keys()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out))
"""


@pytest.fixture
def outsider() -> Iterator[Outsider]:
    with outsider_network() as out:
        yield out


def _steps(run: Any) -> list[int]:
    return [e.step for e in run.events if isinstance(e, StepEvent) and e.committed]


def _rank_listeners(run_id: str) -> list[tuple[str, str, int]]:
    """(actor, bound address, port) of every TCP listener of the run's rank processes,
    Ray's own core-worker server left out."""
    import ray
    from ray._private import state

    ss = require("ss", "ss")["ss"]
    table = subprocess.run([ss, "-ltnpH"], capture_output=True, text=True, check=True).stdout

    ray_port = {
        int(a["Pid"]): int(a["Address"]["Port"])
        for a in state.actors().values()
        if a.get("State") == "ALIVE" and a.get("Pid")
    }
    found: list[tuple[str, str, int]] = []
    for name in ray.util.list_named_actors():
        if not (isinstance(name, str) and name.startswith(trainer_prefix(run_id))):
            continue
        pid = int(ray.get(ray.get_actor(name).pid.remote(), timeout=60))  # type: ignore[call-overload]
        for line in table.splitlines():
            if f"pid={pid}," not in line:
                continue
            host, _, port = line.split()[3].rpartition(":")
            if int(port) != ray_port.get(pid):
                found.append((name, host.strip("[]").removeprefix("::ffff:"), int(port)))
    return found


def test_rank_listeners_bind_the_cluster_address_and_an_outsider_reads_no_store_key(
    ray_local: None, outsider: Outsider, tmp_path: Path
) -> None:
    import ray

    from stages.netsec import cluster_address

    cfg = _config(
        tmp_path,
        # Still training when the probes are done; the test's end cancels it.
        target=TrainingTarget(max_steps=5000, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        standbys=0,
        replica_groups=1,
        ranks_per_group=2,
        parallel=ParallelLayout(tp=1, dp_shard=2),
        worker_num_cpus=0.25,
    )
    with Run(cfg, tmp_path, "listeners") as run:
        run.wait_for(lambda e: isinstance(e, StepEvent) and e.committed and e.step >= 5, "5 steps")
        listeners = _rank_listeners("listeners")
        rank0 = ray.get_actor(f"{trainer_prefix('listeners')}rg0-rank0")
        host, port = ray.get(rank0.store_address.remote(), timeout=60)  # type: ignore[var-annotated]
        # The run's own node reads the store (the path is real, the keys are there).
        from torch.distributed import TCPStore

        own = TCPStore(
            str(host), int(port), is_master=False, wait_for_workers=False, timeout=PROBE_TIMEOUT
        )
        own_keys = own.list_keys()
        probe = outsider.run(sys.executable, "-c", STORE_PROBE, str(host), str(port))
        training = _steps(run)
        run.wait_for(
            lambda e: isinstance(e, StepEvent) and e.committed and e.step > max(training),
            "a step after the probes",
        )

    listing = "\n".join(f"{n} {h}:{p}" for n, h, p in sorted(listeners))
    node = ray.util.get_node_ip_address()
    assert node not in ("127.0.0.1", *WILDCARDS) and cluster_address() == node
    # The group's store: the run's node reads its keys, the outsider none.
    assert own_keys, "the group's store holds no key"
    assert probe.returncode == 0, probe.stderr[-2000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert got["connected"], f"the outsider's network path to the store is not there: {got}"
    assert got["answer"] == "closed", f"the store kept an outsider's connection: {got}"
    assert "keys" not in got, f"an outsider read the group store's keys: {got}"
    # Both ranks listen (heal servers, gloo; rank 0 also the store's and the
    # ManagerServer's fronts) and not one listener is on a wildcard address.
    assert {n for n, _, _ in listeners} == {
        f"{trainer_prefix('listeners')}rg0-rank{r}" for r in range(2)
    }, listing
    assert not [li for li in listeners if li[1] in WILDCARDS], f"wildcard:\n{listing}"
    assert {h for _, h, _ in listeners} <= {node, "127.0.0.1"}, listing
