"""What costs money is priced and bounded: post-training in the cost the approver
confirms and the budget ceiling, and a per-account cap on active runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from helpers.manifests import example_manifest, gsm8k_ref, manifest_payload
from helpers.tenants import make_tenant

from orchestrator.api import create_app
from orchestrator.db.store import Store
from orchestrator.gates.manifest import Manifest
from orchestrator.gates.validation import post_training_work
from orchestrator.settings import Settings

from .conftest import Api, code_of


def _rlvr(api: Api, **rlvr: Any) -> dict[str, Any]:
    return api.manifest(post_training={"rlvr": {"data": gsm8k_ref(api.tmp), "steps": 10, **rlvr}})


def _plan(api: Api, m: dict[str, Any]) -> Any:
    return api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(m)},
        headers=api.h(api.t.approver),
    )


def test_every_rollout_size_raises_the_post_training_cost() -> None:
    ref = example_manifest()["data"]["refs"][0]

    def work(**rlvr: Any) -> Any:
        m = example_manifest(post_training={"rlvr": {"data": ref, "steps": 10, **rlvr}})
        return post_training_work(Manifest.model_validate(m), active_params=10**9)

    base = work()
    assert base.rollout_flops > 0 and base.learner_flops > 0
    for bigger in (
        {"group_size": 16},
        {"groups_per_step": 8},
        {"max_completion_tokens": 512},
        {"steps": 20},
        {"max_dropped_groups_per_step": 64},
    ):
        w = work(**bigger)
        assert w.rollout_flops > base.rollout_flops, bigger
    # Regenerated groups are priced only where dynamic sampling can drop them.
    assert work(dynamic_sampling=False).rollout_flops < base.rollout_flops
    # More rollout workers generate the same tokens on more of the booked GPUs: faster.
    spread = dict(gpus=8, peak_flops=1e15, mfu=0.4, rollout_mfu=0.1)
    assert work(rollout_workers=4).hours(**spread) < base.hours(**spread)
    sft = post_training_work(
        Manifest.model_validate(
            example_manifest(post_training={"sft": {"data": ref, "steps": 10, "batch_size": 8}})
        ),
        10**9,
    )
    assert sft.learner_flops == 6 * 10**9 * 10 * 8 * 256 and sft.rollout_flops == 0


def test_post_training_raises_the_cost_the_approver_must_confirm(api: Api) -> None:
    base = _plan(api, api.manifest()).json()["data"]
    assert base["validation"]["cost"]["post_training_hours"] == 0
    m = _rlvr(api, group_size=16, groups_per_step=8, max_completion_tokens=256)
    priced = _plan(api, m).json()["data"]
    assert priced["validation"]["cost"]["post_training_hours"] > 0
    assert priced["cost_estimate_usd"] > base["cost_estimate_usd"]
    # An approver who confirmed the pretraining-only price did not confirm this run.
    ref = api.ref(manifest=m, cost_usd=base["cost_estimate_usd"])
    r = api.submit(manifest=m, ref=ref)
    assert r.status_code == 403 and code_of(r) == "confirmation_cost_exceeded"
    ref = api.ref(manifest=m, cost_usd=priced["cost_estimate_usd"])
    run = api.run(manifest=m, ref=ref, idem="key-priced-1")
    assert run["cost_estimate_usd"] == priced["cost_estimate_usd"]


def test_an_rlvr_recipe_too_big_for_the_budget_is_refused(api: Api) -> None:
    m = _rlvr(api, steps=5000, group_size=64, groups_per_step=512, max_completion_tokens=8192)
    r = _plan(api, m)
    assert r.status_code == 422 and code_of(r) == "budget_exceeded", r.json()
    r = api.submit(manifest=m, ref=api.ref(manifest=m, cost_usd=10**9))
    assert code_of(r) == "budget_exceeded"
    assert api.store.read("SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0


def test_unbounded_rollout_settings_are_refused_at_the_manifest(api: Api) -> None:
    for field, value in (
        ("rollout_timeout_s", 10**9),
        ("max_dropped_groups_per_step", 10**6),
        ("worker_ready_timeout_s", 1e7),
        ("temperature", 1e6),
    ):
        r = _plan(api, _rlvr(api, **{field: value}))
        assert code_of(r) == "manifest_invalid", (field, r.json())


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[Api]:
    db = tmp_path / "ito.db"
    settings = Settings(
        db_path=db, var_dir=tmp_path / "var", planner_gate=False, max_active_runs_per_account=2
    )
    store = Store(db)
    t = make_tenant(db, "acme")
    make_tenant(db, "globex")
    with TestClient(create_app(settings)) as client:
        yield Api(client, db, tmp_path, t, store)
    store.close()


def test_an_account_past_its_active_run_cap_is_refused_until_one_ends(capped: Api) -> None:
    api = capped
    first = api.run(idem="key-cap-0001")
    api.run(idem="key-cap-0002")
    ref = api.ref()
    r = api.submit(ref=ref, idem="key-cap-0003")
    assert r.status_code == 409 and code_of(r) == "too_many_active_runs"
    # Refused in the transaction that would have consumed it: the confirmation is unspent.
    cancel = api.ref("cancel", run_id=first["run_id"], cost_usd=0.0)
    r = api.client.post(
        f"/v1/runs/{first['run_id']}/cancel",
        json={"confirmation_ref": cancel},
        headers=api.h(api.t.submitter, "key-cancel-01"),
    )
    assert r.json()["data"]["state"] == "cancelled", r.json()
    assert api.submit(ref=ref, idem="key-cap-0003").status_code == 200
    rows = api.store.read("SELECT code FROM audit_events WHERE code = 'too_many_active_runs'")
    assert len(rows) == 1
