"""The parallelism plan in POST /v1/plans (advisory) and as a submit gate (opt-in)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from helpers.manifests import manifest_payload
from helpers.tenants import booking_doc, cpu_booking_doc, make_tenant

from orchestrator.api import create_app
from orchestrator.db.store import Store
from orchestrator.settings import Settings

from .conftest import Api, code_of


def test_plan_is_advisory_with_the_gate_off(api: Api) -> None:
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(api.manifest())},
        headers=api.h(api.t.submitter),
    )
    d = r.json()["data"]
    # llama-tiny on 8 H100s is wasteful to the planner; advisory: the plan call answers.
    assert r.status_code == 200 and d["plan"] is None and d["planner_gate"] is False
    assert d["plan_refusal"]["code"] == "plan_wasteful"
    assert api.submit().status_code == 200


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[Api]:
    db = tmp_path / "ito.db"
    store = Store(db)
    t = make_tenant(db, "acme", booking=cpu_booking_doc("bk-cpu", "acme"))
    settings = Settings(db_path=db, var_dir=tmp_path / "var", planner_gate=True)
    with TestClient(create_app(settings)) as client:
        yield Api(client, db, tmp_path, t, store)
    store.close()


def test_planner_gate_prices_and_stores_the_plan(gated: Api) -> None:
    m = gated.manifest()
    d = gated.client.post(
        "/v1/plans",
        json={"booking_id": "bk-cpu", **manifest_payload(m)},
        headers=gated.h(gated.t.submitter),
    ).json()["data"]
    plan = d["plan"]
    assert plan["world_size"] == 2 and plan["gpu_sku"] == "cpu-testbed"
    cost = d["validation"]["cost"]
    assert cost["method"] == "planner_step_time"
    assert cost["hours"] == pytest.approx(plan["step_time_s"] * 50 / 3600)
    run = gated.run(manifest=m)
    stored = gated.store.get_run(run["run_id"])["plan"]
    assert json.loads(stored)["world_size"] == 2 and run["plan"]["world_size"] == 2


def test_planner_gate_refuses_before_any_run(gated: Api) -> None:
    from orchestrator.gates.bookings import BookingFile, add_booking

    add_booking(gated.store, BookingFile.model_validate(booking_doc("bk-h100", "acme")))
    m = gated.manifest()
    ref = gated.ref(manifest=m, booking_id="bk-h100")
    r = gated.submit(manifest=m, ref=ref, booking_id="bk-h100")
    assert code_of(r) == "plan_wasteful"
    assert gated.store.read("SELECT * FROM runs") == []
    row = gated.store.read("SELECT consumed_at FROM confirmations")[0]
    assert row["consumed_at"] is None


# --- the replica groups' sync: the manifest's pin, through the plan, to the trainer ---


def _plan_call(api: Api, m: dict[str, Any], booking_id: str | None = None) -> Any:
    return api.client.post(
        "/v1/plans",
        json={"booking_id": booking_id or api.t.booking_id, **manifest_payload(m)},
        headers=api.h(api.t.submitter),
    )


def test_a_pinned_diloco_is_planned_and_explained(gated: Api) -> None:
    pin = {"mode": "diloco", "sync_every": 5, "fragments": 1, "outer_lr": 0.7}
    r = _plan_call(gated, gated.manifest(sync=pin), "bk-cpu")
    plan = r.json()["data"]["plan"]
    assert r.status_code == 200 and plan["sync"]["mode"] == "diloco"
    assert plan["sync"]["sync_every"] == 5 and plan["dp_replicate"] == 2
    assert plan["step_time_s"] == plan["step_time_by_sync"]["diloco"]
    assert any("DiLoCo every 5 steps" in x and "as pinned" in x for x in plan["reasons"])


def test_the_testbed_fabric_plans_every_step_sync(gated: Api) -> None:
    plan = _plan_call(gated, gated.manifest(), "bk-cpu").json()["data"]["plan"]
    assert plan["sync"]["mode"] == "every_step"
    assert any("within the 30% share: every step" in x for x in plan["reasons"])


@pytest.mark.parametrize(
    "pin",
    [
        {"mode": "diloco", "sync_every": 4},  # the checkpoint every 10 steps falls mid-interval
        {"mode": "diloco", "sync_every": 1},  # H = 1 is every_step
        {"mode": "diloco", "sync_every": 10, "fragments": 4},  # fragments do not split H
        {"mode": "every_step", "sync_every": 5},  # every_step takes no interval
    ],
    ids=["h-not-dividing-checkpoints", "h-one", "fragments", "every-step-with-h"],
)
def test_an_incoherent_sync_pin_is_refused_at_plan_and_submit(
    api: Api, pin: dict[str, Any]
) -> None:
    # the planner gate is off: the pin is checked anyway, before any run exists
    m = api.manifest(sync=pin)
    r = _plan_call(api, m)
    assert r.status_code == 422 and code_of(r) == "plan_sync_invalid"
    # A confirmation parses the manifest (an incoherent ReplicaSync is refused there);
    # the checkpoint interval and phases are checked by the submit's validation gate.
    confirmed = api.confirm(manifest=m)
    if confirmed["ok"]:
        r = api.submit(manifest=m, ref=confirmed["data"]["confirmation_ref"])
        assert r.status_code == 422 and code_of(r) == "plan_sync_invalid"
    else:
        assert confirmed["error"]["code"] == "plan_sync_invalid"
    assert api.store.read("SELECT * FROM runs") == []


def test_a_diloco_pin_on_one_gpu_is_refused(api: Api) -> None:
    from orchestrator.gates.bookings import BookingFile, add_booking

    add_booking(api.store, BookingFile.model_validate(cpu_booking_doc("bk-one", "acme", gpus=1)))
    r = _plan_call(api, api.manifest(sync={"mode": "diloco", "sync_every": 5}), "bk-one")
    assert r.status_code == 422 and code_of(r) == "plan_sync_invalid"


def test_the_planned_sync_reaches_the_training_stage(tmp_path: Path) -> None:
    """Manifest pin -> ParallelismConfig -> PlanRequest -> Plan.sync -> the stage's
    artifacts -> TrainStageConfig.sync, as the run's pipeline builds it (no Ray)."""
    from helpers.manifests import example_manifest

    from orchestrator.gates.manifest import Manifest
    from orchestrator.gates.planning import plan_manifest
    from orchestrator.runtime.launch import LaunchSpec
    from orchestrator.runtime.pipeline import build_pipeline
    from stages.base import StageContext
    from stages.parallelism import ParallelismStage
    from stages.replica_sync import ReplicaSync

    raw = example_manifest(tmp_path / "ckpt", sync={"mode": "diloco", "sync_every": 5})
    booking = cpu_booking_doc("bk-cpu", "acme")
    spec = LaunchSpec(
        run_id="run_1",
        booking_id="bk-cpu",
        account="acme",
        manifest_digest="d" * 64,
        manifest_json=json.dumps(raw),
        accepted_at=0.0,
        workdir=str(tmp_path / "w"),
        checkpoint_dir=str(tmp_path / "c"),
        facts={"booking": booking},
    )
    stages = dict(build_pipeline(spec))
    ctx = StageContext(run_id="run_1", booking_id="bk-cpu", workdir=tmp_path, facts=spec.facts)
    planning = stages["parallelism"](ctx)
    assert isinstance(planning, ParallelismStage)
    ctx.previous["parallelism"] = planning.run(ctx)
    config = stages["train"](ctx).config  # type: ignore[attr-defined]
    assert config.sync == ReplicaSync(mode="diloco", sync_every=5)
    # ito plan shows the plan the run trains with
    advisory = plan_manifest(Manifest.model_validate(raw), booking)
    assert advisory.plan is not None and advisory.plan["sync"] == config.sync.model_dump()
