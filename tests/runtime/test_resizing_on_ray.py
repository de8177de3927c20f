"""The supervisor (``RayRuntime``, its lease and fenced store) hands a booking's node
change to a real ``RunDriver`` actor over Ray (the session's local Ray; no cluster of
its own): on a cluster it first reserves the added node (a placement group of its
own) and waits while the node has not joined; on the embedded head the run's own
group serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.launch_specs import signed_spec
from helpers.resizing import PLAN
from helpers.store_rows import insert_run
from helpers.tenants import booking_doc, make_tenant

from orchestrator.db.store import Store
from orchestrator.runs import ACTIVE
from orchestrator.runtime import placement
from orchestrator.runtime.driver_lifecycle import driver_name
from orchestrator.runtime.ray_cluster import RAY_NAMESPACE, RaySettings
from orchestrator.runtime.supervisor import RayRuntime
from orchestrator.runtime.supervisor_settings import SupervisorSettings
from stages.events import StageResultEvent

pytestmark = pytest.mark.slow
RUN = "run_ray_resize"
BOOKING = "bk-acme"
RPC_TIMEOUT_S = 30.0  # a hang guard for one actor call


def _pending_in_inbox(handle: Any) -> dict[str, Any] | None:
    import ray

    def peek(driver: Any) -> dict[str, Any] | None:
        request = driver.ctx.resize_inbox.peek()
        return None if request is None else request.model_dump(mode="json")

    result: dict[str, Any] | None = ray.get(handle.__ray_call__.remote(peek), timeout=RPC_TIMEOUT_S)
    return result


def test_the_supervisor_delivers_a_resize_to_the_driver_actor(
    ray_local: None, tmp_path: Path
) -> None:
    import ray

    from orchestrator.runtime.driver import driver_actor_class

    db = tmp_path / "ito.db"
    make_tenant(db, "acme", booking=booking_doc(BOOKING, "acme", node_count=2))
    store = Store(db)
    account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
    insert_run(store, RUN, account_id=account_id, booking_id=BOOKING, state="running")
    outcome = {"stage": "parallelism", "status": "passed", "artifacts": {"plan": PLAN}}
    store.ingest_events(RUN, [{**StageResultEvent(outcome=outcome).model_dump(), "seq": 0}])
    settings = SupervisorSettings(resize_check_interval_s=0.01, rpc_timeout_s=RPC_TIMEOUT_S)
    spec = signed_spec(tmp_path, run_id=RUN)
    handle = (
        driver_actor_class()
        .options(name=driver_name(RUN), namespace=RAY_NAMESPACE, num_cpus=0)
        .remote(spec.model_dump())
    )
    try:
        # On a cluster (not the embedded head) the added node must join, marked with
        # the booking, before the run grows into it: h3 never joins this local Ray, so
        # its group waits (PENDING) and so does the request.
        cluster = RayRuntime(store, tmp_path / "var", RaySettings(address="auto"), settings)
        assert cluster._lead()  # this replica holds the lease: its writes go through
        store.change_booking_nodes(BOOKING, "add", ["h3"])
        cluster._follow_bookings(store.runs_in_states(ACTIVE))
        assert [r["status"] for r in store.run_resizes(RUN)] == ["pending"]
        assert _pending_in_inbox(handle) is None
        added = placement.lookup(RUN, placement.added_pg_name(RUN, 1))
        assert added is not None and placement.state(added) == "PENDING"
        assert "waiting for the 1 added node(s)" in store.get_run(RUN)["state_reason"]
        assert placement.release(RUN)
        assert placement.lookup(RUN, placement.added_pg_name(RUN, 1)) is None
        store.release_lease(cluster.fence)
        # The embedded head is one machine: the run's own group serves; delivered.
        embedded = RayRuntime(store, tmp_path / "var", RaySettings(), settings)
        assert embedded._lead()
        embedded._follow_bookings(store.runs_in_states(ACTIVE))
        request = _pending_in_inbox(handle)
        assert request is not None and request["replica_groups"] == 6
        assert request["nodes"] == ["bk-acme-n0", "bk-acme-n1", "h3"]
        assert request["placement"] is None
        assert [r["status"] for r in store.run_resizes(RUN)] == ["delivered"]
        store.release_lease(embedded.fence)
    finally:
        ray.kill(handle, no_restart=True)
