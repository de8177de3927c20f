"""The supervisor (``RayRuntime``, its lease and fenced store) hands a booking's node
change to a real ``RunDriver`` actor over Ray (the session's local Ray; no cluster of
its own), and keeps it queued while the driver is not there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.launch_specs import signed_spec
from helpers.store_rows import insert_run
from helpers.tenants import booking_doc, make_tenant

from orchestrator.db.store import Store
from orchestrator.runs import ACTIVE
from orchestrator.runtime.ray_cluster import RAY_NAMESPACE, RaySettings
from orchestrator.runtime.supervisor import RayRuntime, SupervisorSettings, driver_name
from stages.events import StageResultEvent

pytestmark = pytest.mark.slow
RUN = "run_ray_resize"
BOOKING = "bk-acme"
PLAN = {
    "tp": 2,
    "pp": 1,
    "cp": 1,
    "dp_shard": 2,
    "dp_replicate": 4,
    "grad_accum": 1,
    "pp_microbatches": 0,
    "global_batch_tokens": 48 * 256,
    "seq_len": 256,
    "gpus_per_node": 8,
    "node_count": 2,
}
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
    rt = RayRuntime(
        store,
        tmp_path / "var",
        RaySettings(),
        SupervisorSettings(resize_check_interval_s=0.01, rpc_timeout_s=RPC_TIMEOUT_S),
    )
    assert rt._lead()  # this replica holds the lease: its fenced writes go through
    store.change_booking_nodes(BOOKING, "add", ["h3"])
    # No driver yet (its name does not resolve): the request waits, pending.
    rt._resized_at = float("-inf")
    rt._follow_bookings(store.runs_in_states(ACTIVE))
    assert [r["status"] for r in store.run_resizes(RUN)] == ["pending"]
    spec = signed_spec(tmp_path, run_id=RUN)
    handle = (
        driver_actor_class()
        .options(name=driver_name(RUN), namespace=RAY_NAMESPACE, num_cpus=0)
        .remote(spec.model_dump())
    )
    try:
        rt._resized_at = float("-inf")
        rt._follow_bookings(store.runs_in_states(ACTIVE))
        request = _pending_in_inbox(handle)
        assert request is not None and request["replica_groups"] == 6
        assert request["nodes"] == ["bk-acme-n0", "bk-acme-n1", "h3"]
        assert [r["status"] for r in store.run_resizes(RUN)] == ["delivered"]
    finally:
        ray.kill(handle, no_restart=True)
        store.release_lease(rt.fence)
