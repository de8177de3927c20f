"""The parallelism plan in POST /v1/plans (advisory) and as a submit gate (opt-in)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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
