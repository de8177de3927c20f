"""The supervisor's resizer: a booking's node change reaches its running run's driver
as a ``ResizeRequest`` (a real ``RunDriverImpl``, its real resize inbox), recorded in
a real store (SQLite and PostgreSQL), queued while the driver does not answer, and
the run paused and resumed with its capacity. Only the transport is swapped: the
supervisor's is a Ray call to the driver actor (``ray_deliver``), here a direct call
of the same method, so no Ray cluster starts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures import both_engines
from helpers.launch_specs import signed_spec
from helpers.resizing import PLAN, embedded_place
from helpers.store_rows import insert_run
from helpers.tenants import booking_doc, make_tenant

from orchestrator.db.store import Store
from orchestrator.runs import RunState
from orchestrator.runtime.driver import RunDriverImpl
from orchestrator.runtime.resizing import Resizer
from stages.events import InterruptionEvent, StageResultEvent

pytestmark = both_engines

RUN = "run_resize"
BOOKING = "bk-acme"


class Transport:
    """Calls the driver's ``resize`` as the actor call would; ``down`` makes it fail
    as an unreachable actor does."""

    def __init__(self) -> None:
        self.down = False
        self.sent: list[str] = []

    def __call__(self, driver: RunDriverImpl, request: dict[str, Any]) -> None:
        if self.down:
            raise TimeoutError("the driver did not answer")
        driver.resize(request)
        self.sent.append(request["request_id"])


@pytest.fixture
def world(db: str, tmp_path: Path) -> tuple[Store, RunDriverImpl, Transport, Resizer]:
    make_tenant(db, "acme", booking=booking_doc(BOOKING, "acme", node_count=2))
    store = Store(db)
    account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
    insert_run(store, RUN, account_id=account_id, booking_id=BOOKING, state="running")
    # The run planned (its parallelism stage passed), as its driver reports it.
    outcome = {"stage": "parallelism", "status": "passed", "artifacts": {"plan": PLAN}}
    store.ingest_events(RUN, [{**StageResultEvent(outcome=outcome).model_dump(), "seq": 0}])
    driver = RunDriverImpl(signed_spec(tmp_path, run_id=RUN).model_dump(), use_ray_metrics=False)
    transport = Transport()
    drivers: dict[str, RunDriverImpl] = {RUN: driver}
    return store, driver, transport, Resizer(store, drivers.get, transport, embedded_place)


def _follow(store: Store, resizer: Resizer) -> None:
    resizer.follow(store.runs_in_states([RunState.running, RunState.paused_capacity]))


def test_added_nodes_reach_the_driver_as_a_resize_request(
    world: tuple[Store, RunDriverImpl, Transport, Resizer],
) -> None:
    store, driver, transport, resizer = world
    _follow(store, resizer)
    assert driver.ctx.resize_inbox.peek() is None  # no change, no request
    before = time.time()
    change = store.change_booking_nodes(BOOKING, "add", ["h3"])
    _follow(store, resizer)
    request = driver.ctx.resize_inbox.take()
    assert request is not None
    assert request.replica_groups == 6  # 24 GPUs: 6 whole groups of 4 ranks
    assert request.nodes == ("bk-acme-n0", "bk-acme-n1", "h3")
    assert request.requested_at == pytest.approx(change["ts"]) and request.requested_at >= before
    assert "6 whole group(s)" in request.reason
    (record,) = store.run_resizes(RUN)
    assert record["status"] == "delivered" and record["groups_before"] == 4
    assert record["request_id"] == request.request_id
    # Handled once: the next passes send nothing again.
    _follow(store, resizer)
    assert driver.ctx.resize_inbox.peek() is None and transport.sent == [request.request_id]
    # Taken back: 6 -> 4 groups, counted from the last resize.
    store.change_booking_nodes(BOOKING, "remove", ["h3"])
    _follow(store, resizer)
    back = driver.ctx.resize_inbox.take()
    assert back is not None and back.replica_groups == 4 and back.request_id != request.request_id
    assert [r["groups_before"] for r in store.run_resizes(RUN)] == [4, 6]


def test_an_unreachable_driver_gets_the_request_on_a_later_pass(
    world: tuple[Store, RunDriverImpl, Transport, Resizer],
) -> None:
    store, driver, transport, resizer = world
    transport.down = True
    store.change_booking_nodes(BOOKING, "add", ["h3"])
    _follow(store, resizer)
    _follow(store, resizer)
    assert driver.ctx.resize_inbox.peek() is None
    assert [r["status"] for r in store.run_resizes(RUN)] == ["pending"]
    transport.down = False
    _follow(store, resizer)
    request = driver.ctx.resize_inbox.take()
    assert request is not None and request.replica_groups == 6
    assert [r["status"] for r in store.run_resizes(RUN)] == ["delivered"]


def test_a_newer_change_supersedes_a_resize_not_delivered_yet(
    world: tuple[Store, RunDriverImpl, Transport, Resizer],
) -> None:
    store, driver, transport, resizer = world
    transport.down = True
    store.change_booking_nodes(BOOKING, "add", ["h3"])
    _follow(store, resizer)
    store.change_booking_nodes(BOOKING, "add", ["h4"])
    _follow(store, resizer)
    transport.down = False
    _follow(store, resizer)
    request = driver.ctx.resize_inbox.take()
    assert request is not None and request.replica_groups == 8  # 4 nodes, 8 groups
    assert len(transport.sent) == 1 and request.placement is None  # the run's own group
    records = store.run_resizes(RUN)
    assert [(r["status"], r["groups_before"]) for r in records] == [
        ("superseded", 4),
        ("delivered", 4),
    ]


def test_a_relaunched_driver_gets_the_runs_latest_size_again(
    world: tuple[Store, RunDriverImpl, Transport, Resizer], tmp_path: Path
) -> None:
    """A driver relaunched after a loss starts its trainer from the run's plan: the
    supervisor sends it the latest delivered size, once, recording nothing new."""
    store, driver, transport, _ = world
    drivers = {RUN: driver}
    resizer = Resizer(store, drivers.get, transport, embedded_place)
    store.change_booking_nodes(BOOKING, "remove", ["bk-acme-n1"])
    _follow(store, resizer)
    assert driver.ctx.resize_inbox.take() is not None
    # A new supervisor (a restart, a takeover) with the same driver sends nothing again.
    _follow(store, Resizer(store, drivers.get, transport, embedded_place))
    assert driver.ctx.resize_inbox.peek() is None and len(transport.sent) == 1
    # The driver was lost and launched again, as the supervisor records it.
    lost = InterruptionEvent(
        interruption_kind="driver_lost", detected_at=time.time(), recovered_at=time.time()
    )
    store.ingest_events(RUN, [{**lost.model_dump(mode="json"), "seq": store.max_seq(RUN) + 1}])
    logs = len(store.list_logs(RUN, 0, 1000))
    drivers[RUN] = RunDriverImpl(
        signed_spec(tmp_path, run_id=RUN, attempt=2).model_dump(), use_ray_metrics=False
    )
    _follow(store, resizer)
    _follow(store, resizer)
    again = drivers[RUN].ctx.resize_inbox.take()
    assert again is not None and again.replica_groups == 2
    assert driver.ctx.resize_inbox.peek() is None and len(transport.sent) == 2
    assert [r["status"] for r in store.run_resizes(RUN)] == ["delivered"]
    assert len(store.list_logs(RUN, 0, 1000)) == logs


def test_growth_the_planner_refuses_is_recorded_and_not_sent(
    world: tuple[Store, RunDriverImpl, Transport, Resizer],
) -> None:
    store, driver, _, resizer = world
    # 2 -> 4 nodes: 8 whole groups; 48 sequences split over 8 x 2 ranks.
    store.change_booking_nodes(BOOKING, "add", ["h3", "h4"])
    _follow(store, resizer)
    request = driver.ctx.resize_inbox.take()
    assert request is not None and request.replica_groups == 8
    # One node more: 10 groups fit, neither 9 nor 10 splits the batch: refused, recorded.
    store.change_booking_nodes(BOOKING, "add", ["h5"])
    _follow(store, resizer)
    assert driver.ctx.resize_inbox.peek() is None
    refused = store.run_resizes(RUN)[-1]
    assert (refused["status"], refused["code"]) == ("refused", "plan_resize_batch_not_divisible")
    assert refused["replica_groups"] == 8
    logs = [r["message"] for r in store.list_logs(RUN, 0, 100)]
    assert any("resize refused: plan_resize_batch_not_divisible" in m for m in logs)


def test_below_one_group_the_run_pauses_and_resumes_when_capacity_returns(
    world: tuple[Store, RunDriverImpl, Transport, Resizer],
) -> None:
    store, driver, _, resizer = world
    store.change_booking_nodes(BOOKING, "remove", ["bk-acme-n0", "bk-acme-n1"])
    _follow(store, resizer)
    paused = driver.ctx.resize_inbox.take()
    assert paused is not None and paused.replica_groups == 0 and paused.nodes == ()
    run = store.get_run(RUN)
    assert (
        run["state"] == "paused_capacity" and "less than one replica group" in run["state_reason"]
    )
    store.change_booking_nodes(BOOKING, "add", ["h7"])
    _follow(store, resizer)
    resumed = driver.ctx.resize_inbox.take()
    assert resumed is not None and resumed.replica_groups == 2 and resumed.nodes == ("h7",)
    assert store.get_run(RUN)["state"] == "running"


@pytest.mark.parametrize(
    "plan",
    [
        {**PLAN, "node_count": 3, "dp_replicate": 6},
        # RLVR's rollout workers hold 4 GPUs of each node: the trainer's 12 hold 3 groups.
        {
            **PLAN,
            "node_count": 3,
            "gpus_per_node": 4,
            "rollout_gpus_per_node": 4,
            "dp_replicate": 3,
        },
    ],
    ids=["whole-nodes", "rollout-gpus-held"],
)
def test_a_change_the_runs_plan_already_holds_sends_nothing(
    db: str, tmp_path: Path, plan: dict[str, Any]
) -> None:
    """Nodes added after the run was accepted but before it planned are in its plan:
    the resizer records the change as answered and sends no request."""
    make_tenant(db, "acme", booking=booking_doc(BOOKING, "acme", node_count=2))
    store = Store(db)
    account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
    insert_run(store, RUN, account_id=account_id, booking_id=BOOKING, state="running")
    store.change_booking_nodes(BOOKING, "add", ["h3"])
    outcome = {"stage": "parallelism", "status": "passed", "artifacts": {"plan": plan}}
    store.ingest_events(RUN, [{**StageResultEvent(outcome=outcome).model_dump(), "seq": 0}])
    driver = RunDriverImpl(signed_spec(tmp_path, run_id=RUN).model_dump(), use_ray_metrics=False)
    transport = Transport()
    resizer = Resizer(store, {RUN: driver}.get, transport, embedded_place)
    _follow(store, resizer)
    _follow(store, resizer)
    assert driver.ctx.resize_inbox.peek() is None and transport.sent == []
    assert [(r["status"], r["replica_groups"]) for r in store.run_resizes(RUN)] == [
        ("unchanged", plan["dp_replicate"])
    ]


def test_changes_before_the_run_was_accepted_are_in_its_plan_and_not_sent(
    db: str, tmp_path: Path
) -> None:
    """A node taken back before the run was accepted: the run planned on the smaller
    booking, so there is nothing to move."""
    make_tenant(db, "acme", booking=booking_doc(BOOKING, "acme", node_count=3))
    store = Store(db)
    store.change_booking_nodes(BOOKING, "remove", ["bk-acme-n2"])
    account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
    insert_run(store, RUN, account_id=account_id, booking_id=BOOKING, state="running")
    outcome = {"stage": "parallelism", "status": "passed", "artifacts": {"plan": PLAN}}
    store.ingest_events(RUN, [{**StageResultEvent(outcome=outcome).model_dump(), "seq": 0}])
    driver = RunDriverImpl(signed_spec(tmp_path, run_id=RUN).model_dump(), use_ray_metrics=False)
    transport = Transport()
    _follow(store, Resizer(store, {RUN: driver}.get, transport, embedded_place))
    assert transport.sent == [] and store.run_resizes(RUN) == []


def test_a_node_swap_names_the_booking_s_ray_nodes_and_reserves_the_gained_one(
    world: tuple[Store, RunDriverImpl, Transport, Resizer],
) -> None:
    """One node taken back and one gained in one pass: the count stays, and the request
    still goes out, with the Ray nodes the booking's nodes are (the trainer drains the
    groups on the others) and the gained node reserved for the groups that move."""
    store, driver, transport, _ = world
    placed: list[tuple[str, ...]] = []

    def place(run_id: str, change_id: int, booking: dict[str, Any], nodes: tuple[str, ...]) -> None:
        placed.append(nodes)

    ray_nodes = {"bk-acme-n0": "id0", "bk-acme-n1": "id1", "h3": "id3"}
    resizer = Resizer(
        store,
        {RUN: driver}.get,
        transport,
        place,
        locate=lambda names: tuple(ray_nodes[n] for n in names),
    )
    store.change_booking_nodes(BOOKING, "remove", ["bk-acme-n0"])
    store.change_booking_nodes(BOOKING, "add", ["h3"])
    _follow(store, resizer)
    request = driver.ctx.resize_inbox.take()
    assert request is not None and request.replica_groups == 4  # 2 nodes x 2 groups still
    assert request.nodes == ("bk-acme-n1", "h3") and request.node_ids == ("id1", "id3")
    assert placed == [("h3",)]
    assert [r["status"] for r in store.run_resizes(RUN)] == ["delivered"]
