"""The supervisor lease's takeover under a real run: two ``ito-backend serve`` replicas
on one real PostgreSQL, both joined to one real local Ray head (``--ray-address``)
that neither of them owns.

Replica A leads and launches the run's detached driver; A is SIGKILLed mid-run (no
shutdown hook runs, its lease is not released); B takes the lease over with the next
fencing token, reattaches to the live driver by name and drives the run to
``succeeded`` without relaunching it; a write made with A's lease is refused. Only
the GPUs are absent: every process, kill and Ray actor here is real.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.backend import Backend, free_port
from helpers.flows import submit_run
from helpers.manifests import cpu_testbed_manifest, data_ref
from helpers.postgres import PgServer
from helpers.ray_backend import python_docs_corpus
from helpers.ray_local import note_start, start_turn
from helpers.tenants import Tenant, cpu_booking_doc, make_tenant
from helpers.waiting import wait_until

from orchestrator.db.store import Fence, Store
from orchestrator.runtime import ray_cluster
from orchestrator.runtime.placement import embedded_marks
from orchestrator.runtime.ray_cluster import RaySettings
from orchestrator.runtime.supervisor import LEASE_NAME
from stages.errors import ErrorCode, ItoError
from stages.events import LogEvent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Short, so the takeover is quick; at least 3 polls (the default 0.5 s poll).
LEASE_S = 5.0
# Hang guards for a loaded 2-core machine, not bounds under test.
WAIT_S = float(os.environ.get("ITO_TEST_WAIT_S", "240"))
# Paced steps: the run is still training when A is killed.
STEPS = 40
PACE_STEP_S = 0.2
BOOKING = "bk-ha"


@pytest.fixture
def world(
    pg_server: PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    db = pg_server.new_database()
    # One launch key for both replicas and the node, as deploy/k8s shares it by Secret.
    env = {"ITO_LAUNCH_KEY_FILE": str(tmp_path / "launch.key")}
    # The head's raylet (and so every driver on it) reads the same key.
    monkeypatch.setenv("ITO_LAUNCH_KEY_FILE", env["ITO_LAUNCH_KEY_FILE"])
    head_dir = tmp_path / "ray"
    head = RaySettings(
        head_port=free_port(),
        dashboard_port=free_port(),
        client_server_port=free_port(),
        dashboard_agent_listen_port=free_port(),
        num_cpus=4,
        # The booking's node mark: one raylet is the whole cluster, as cheap as Ray gets.
        node_resources=embedded_marks([{"booking_id": BOOKING, "gpus_per_node": 1}]),
        head_start_timeout_s=WAIT_S,
    )
    tenant = make_tenant(db, "acme", booking=cpu_booking_doc(BOOKING, "acme", gpus=1))
    corpus = python_docs_corpus(tmp_path / "data" / "train.jsonl", 300)
    replicas: list[Backend] = []

    def replica(name: str) -> Backend:
        be = Backend(
            db=db,
            var_dir=tmp_path / name / "var",
            log_path=tmp_path / f"{name}.log",
            extra_args=["--runtime", "ray", "--ray-address", address],
            env={
                **env,
                "ITO_SUPERVISOR_LEASE_S": str(LEASE_S),
                "ITO_TRAIN_OVERRIDES": json.dumps({"pace_step_s": PACE_STEP_S}),
            },
        )
        (tmp_path / name).mkdir()
        replicas.append(be)
        return be.start()

    store = Store(db)
    try:
        with start_turn():
            address = ray_cluster.start_local_head(head_dir, head)
        note_start("embedded-head", str(head_dir))
        yield {
            "store": store,
            "tenant": tenant,
            "replica": replica,
            "corpus": corpus,
            "tmp": tmp_path,
            "logs": lambda: "\n".join(
                f"--- {b.log_path.name}\n{b.log_text()[-3000:]}" for b in replicas
            ),
        }
    finally:
        for be in replicas:
            be.stop()
        store.close()
        ray_cluster.stop_local_head(head_dir)


def _manifest(corpus: Path, ckpt: Path) -> dict[str, Any]:
    return cpu_testbed_manifest(
        [data_ref(corpus, license="PSF")],
        ckpt,
        steps=STEPS,
        name=f"ha-{uuid.uuid4().hex[:6]}",
        interval_steps=10,
        keep=1,
    )


def _holder_pid(store: Store) -> int | None:
    row = store.lease(LEASE_NAME)
    return int(row["holder"].split(":")[1]) if row else None


def _last_step(store: Store, run_id: str) -> int:
    steps = [e["payload"].get("step") or 0 for e in store.list_events(run_id, kinds=["step"])]
    return max(steps, default=0)


def test_leader_sigkilled_mid_run_standby_adopts_the_driver_and_fences_the_old_leader(
    world: dict[str, Any],
) -> None:
    store: Store = world["store"]
    t: Tenant = world["tenant"]
    a: Backend = world["replica"]("a")
    assert a.proc is not None
    a_pid = a.proc.pid
    wait_until(lambda: _holder_pid(store) == a_pid, WAIT_S, "replica a to lead")
    b: Backend = world["replica"]("b")
    assert b.proc is not None
    with b.client() as c:  # any replica serves the API; only the leader supervises
        m = _manifest(world["corpus"], world["tmp"] / "ckpt")
        run_id = submit_run(c, t, BOOKING, m)

    def stepping() -> bool:
        state = store.get_run(run_id)["state"]
        assert state not in ("failed", "cancelled"), f"{state}\n{world['logs']()}"
        return state == "running" and _last_step(store, run_id) >= 3

    wait_until(stepping, WAIT_S, "the run to train a few steps")
    # A leads first; under load its short lease may already have passed to B (a
    # takeover too): the leader now is the one killed, the other must take over.
    leader, standby = (a, b) if _holder_pid(store) == a.proc.pid else (b, a)
    assert leader.proc is not None and standby.proc is not None
    lease_a = store.lease(LEASE_NAME)
    assert lease_a is not None and _holder_pid(store) == leader.proc.pid
    assert store.get_run(run_id)["state"] == "running"
    stale = Fence(LEASE_NAME, lease_a["holder"], int(lease_a["token"]))

    os.kill(leader.proc.pid, signal.SIGKILL)  # a real kill: no shutdown hook, no release
    leader.proc.wait(30)
    assert _last_step(store, run_id) < STEPS  # killed mid-run

    standby_pid = standby.proc.pid
    wait_until(
        lambda: _holder_pid(store) == standby_pid, WAIT_S, "the standby to take the lease over"
    )
    lease_b = store.lease(LEASE_NAME)
    assert lease_b is not None and lease_b["token"] == lease_a["token"] + 1

    def finished() -> bool:
        return store.get_run(run_id)["state"] in ("succeeded", "failed", "cancelled")

    wait_until(finished, WAIT_S, "the standby to drive the run to its end")
    run = store.get_run(run_id)
    assert run["state"] == "succeeded", f"{run['state_reason']}\n{world['logs']()}"
    assert _last_step(store, run_id) == STEPS
    # Adopted, not relaunched: the driver A launched lived on; the standby pulled its events.
    lost = store.list_events(run_id, kinds=["interruption"])
    assert not [e for e in lost if e["payload"].get("interruption_kind") == "driver_lost"]
    seqs = [e["seq"] for e in store.list_events(run_id, limit=100_000)]
    assert seqs == sorted(set(seqs)) and seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    # The old leader's lease writes nothing: its write is refused by the fence, while
    # the same write under the current lease goes in.
    def note(fence: Fence) -> None:
        seq = store.max_seq(run_id) + 1
        event = LogEvent(stage="orchestrator", message=f"written under token {fence.token}")
        store.fenced(fence).ingest_events(run_id, [{**event.model_dump(mode="json"), "seq": seq}])

    with pytest.raises(ItoError) as refused:
        note(stale)
    assert refused.value.code == ErrorCode.lease_lost
    note(Fence(LEASE_NAME, lease_b["holder"], int(lease_b["token"])))
    written = [e["payload"]["message"] for e in store.list_events(run_id, kinds=["log"])]
    assert f"written under token {lease_b['token']}" in written
    assert f"written under token {lease_a['token']}" not in written
    assert store.get_run(run_id)["state"] == "succeeded"
