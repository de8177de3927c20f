"""Cancel, cleanup, proposal decisions and booking release (NullRuntime)."""

from __future__ import annotations

from typing import Any

from helpers.fixtures import both_engines

from orchestrator.runs import RunState
from orchestrator.runtime.interface import run_dir

from .conftest import Api, code_of

# The contract holds on both engines: SQLite (embedded) and PostgreSQL (replicas).
pytestmark = both_engines


def _post(api: Api, path: str, ref: str, idem: str) -> Any:
    return api.client.post(
        path, json={"confirmation_ref": ref}, headers=api.h(api.t.submitter, idem)
    )


def test_cancel_with_confirmation_and_replay(api: Api) -> None:
    run = api.run()
    rid = run["run_id"]
    r = _post(api, f"/v1/runs/{rid}/cancel", "itoc_missing-ref-xyz", "cancel-k-01")
    assert code_of(r) == "confirmation_not_found"
    ref = api.ref("cancel", run_id=rid, cost_usd=0)
    r = _post(api, f"/v1/runs/{rid}/cancel", ref, "cancel-k-01")
    assert r.status_code == 200 and r.json()["data"]["state"] == "cancelled"
    again = _post(api, f"/v1/runs/{rid}/cancel", ref, "cancel-k-01").json()
    assert again["ok"] and again["data"]["replayed"] is True
    # A second cancel with a fresh confirmation: terminal runs cannot be cancelled.
    ref2 = api.ref("cancel", run_id=rid, cost_usd=0)
    r = _post(api, f"/v1/runs/{rid}/cancel", ref2, "cancel-k-02")
    assert r.status_code == 409 and code_of(r) == "invalid_state"
    # ... and the refused mutation did not consume its confirmation.
    row = api.store.read_one(
        "SELECT consumed_at FROM confirmations WHERE action='cancel' AND consumed_at IS NULL"
    )
    assert row is not None


def test_cleanup_needs_terminal_run_and_keeps_booking(api: Api) -> None:
    run = api.run()
    rid = run["run_id"]
    scratch = run_dir(api.tmp / "var", rid)
    (scratch / "data").mkdir(parents=True)
    (scratch / "data" / "shard.bin").write_bytes(b"x" * 1000)
    ref = api.ref("cleanup", run_id=rid, cost_usd=0)
    r = _post(api, f"/v1/runs/{rid}/cleanup", ref, "clean-k-001")
    assert code_of(r) == "invalid_state"  # accepted is not terminal
    cref = api.ref("cancel", run_id=rid, cost_usd=0)
    assert _post(api, f"/v1/runs/{rid}/cancel", cref, "cancel-k-10").status_code == 200
    # A cancel confirmation cannot clean up.
    assert (
        code_of(_post(api, f"/v1/runs/{rid}/cleanup", api.ref("cancel", run_id=rid), "clean-k-002"))
        == "confirmation_action_mismatch"
    )
    booking_before = api.store.booking(api.t.booking_id)
    r = _post(api, f"/v1/runs/{rid}/cleanup", ref, "clean-k-003")
    d = r.json()["data"]
    assert r.status_code == 200 and d["run"]["state"] == "cleaned"
    assert d["removed"] == [str(scratch)] and d["bytes_removed"] == 1000
    assert not scratch.exists()
    # The booking row is exactly as before, not only the response saying so.
    assert api.store.booking(api.t.booking_id) == booking_before
    assert (booking_before or {})["state"] == "active"
    replay = _post(api, f"/v1/runs/{rid}/cleanup", ref, "clean-k-003").json()["data"]
    assert replay["replayed"] is True and replay["removed"] == [str(scratch)]
    # Same key, other request: conflict.
    r = _post(api, f"/v1/runs/{rid}/cancel", cref, "clean-k-003")
    assert code_of(r) == "idempotency_conflict"


def test_release_is_a_separate_confirmed_action(api: Api) -> None:
    run = api.run()
    rid = run["run_id"]
    bid = api.t.booking_id
    ref = api.ref("release", cost_usd=0)
    r = _post(api, f"/v1/bookings/{bid}/release", ref, "release-k1")
    assert code_of(r) == "invalid_state"  # a run is still active on the booking
    _post(api, f"/v1/runs/{rid}/cancel", api.ref("cancel", run_id=rid), "cancel-k-20")
    # A cleanup confirmation never releases the booking.
    wrong = api.ref("cleanup", run_id=rid)
    assert (
        code_of(_post(api, f"/v1/bookings/{bid}/release", wrong, "release-k2"))
        == "confirmation_action_mismatch"
    )
    r = _post(api, f"/v1/bookings/{bid}/release", ref, "release-k3")
    assert r.status_code == 200 and r.json()["data"]["state"] == "released"
    assert (api.store.booking(bid) or {})["state"] == "released"
    assert (
        _post(api, f"/v1/bookings/{bid}/release", ref, "release-k3").json()["data"]["replayed"]
        is True
    )


def test_proposal_approve_and_decline(api: Api) -> None:
    run = api.run()
    rid = run["run_id"]
    # The runtime reports a loss spike proposal while the run is running.
    api.store.transition(rid, RunState.starting)
    api.store.transition(rid, RunState.running)
    api.store.ingest_events(
        rid,
        [
            {
                "seq": 0,
                "kind": "proposal",
                "proposal_id": "p1",
                "action": "restart_from_checkpoint",
                "description": "loss spike at step 40",
                "params": {"step": 30},
            },
            {
                "seq": 1,
                "kind": "proposal",
                "proposal_id": "p2",
                "action": "restart_from_checkpoint",
                "description": "second spike",
                "params": {},
            },
        ],
    )
    api.store.transition(rid, RunState.awaiting_approval, "proposal p1")
    base = f"/v1/runs/{rid}/proposals"
    # approve needs a restart confirmation bound to this run and proposal.
    ref_p2 = api.ref("restart", run_id=rid, proposal_id="p2", cost_usd=0)
    assert (
        code_of(_post(api, f"{base}/p1/approve", ref_p2, "approve-k1"))
        == "confirmation_run_mismatch"
    )
    assert code_of(_post(api, f"{base}/nope/approve", ref_p2, "approve-k2")) == "proposal_not_found"
    assert (
        api.confirm("restart", run_id=rid, proposal_id="nope")["error"]["code"]
        == "proposal_not_found"
    )
    ref_p1 = api.ref("restart", run_id=rid, proposal_id="p1", cost_usd=0)
    r = _post(api, f"{base}/p1/approve", ref_p1, "approve-k3")
    assert r.status_code == 200
    assert {p["proposal_id"]: p["status"] for p in r.json()["data"]["proposals"]} == {
        "p1": "approved",
        "p2": "pending",
    }
    r = _post(api, f"{base}/p2/decline", ref_p2, "decline-k1")
    assert r.status_code == 200
    # Deciding again (new confirmation) is invalid_state: a decision is final.
    again = api.ref("restart", run_id=rid, proposal_id="p1")
    assert code_of(_post(api, f"{base}/p1/decline", again, "decline-k2")) == "invalid_state"


def test_logs_metrics_checkpoints(api: Api) -> None:
    run = api.run()
    rid = run["run_id"]
    api.store.ingest_events(
        rid,
        [
            {"seq": 0, "kind": "log", "message": "hello", "stage": "data_prep", "ts": 100.0},
            {
                "seq": 1,
                "kind": "step",
                "step": 1,
                "loss": 2.5,
                "tokens": 512,
                "seconds": 1.0,
                "committed": True,
                "ts": 101.0,
            },
            {
                "seq": 2,
                "kind": "checkpoint",
                "step": 1,
                "path": "/x/1",
                "bytes": 2000,
                "blocking_s": 0.1,
                "total_s": 2.0,
                "ts": 102.0,
            },
            {
                "seq": 3,
                "kind": "stage_result",
                "stage": "data_prep",
                "outcome": {
                    "stage": "data_prep",
                    "status": "passed",
                    "reason": "ok",
                    "metrics": {"docs": 10.0},
                },
                "ts": 103.0,
            },
        ],
    )
    h = api.h(api.t.submitter)
    first = api.client.get(f"/v1/runs/{rid}/logs", params={"limit": 1}, headers=h).json()["data"]
    assert len(first["entries"]) == 1
    rest = api.client.get(
        f"/v1/runs/{rid}/logs", params={"cursor": first["next_cursor"]}, headers=h
    ).json()["data"]
    messages = [e["message"] for e in first["entries"] + rest["entries"]]
    assert "hello" in messages and messages[0].startswith("accepted")
    ck = api.client.get(f"/v1/runs/{rid}/checkpoints", headers=h).json()["data"]
    assert ck["checkpoints"][0]["bytes_per_s"] == 1000.0
    met = api.client.get(f"/v1/runs/{rid}/metrics", headers=h).json()["data"]
    assert met["steps_committed"] == 1 and met["checkpoint_bytes_per_s"] == 1000.0
    assert met["productive_s"] == 1.0 and 0 < met["goodput"] <= 1
    view = api.client.get(f"/v1/runs/{rid}", headers=h).json()["data"]
    assert view["stage_gates"][0]["status"] == "passed"
    for cursor in ("abc", "9" * 30):
        bad = api.client.get(f"/v1/runs/{rid}/logs", params={"cursor": cursor}, headers=h)
        assert code_of(bad) == "bad_request"


def test_other_tenant_cannot_mutate(api: Api) -> None:
    from helpers.tenants import make_tenant

    run = api.run()
    other = make_tenant(api.db, "globex")
    env = api.confirm(
        "cancel", key=other.approver, booking_id=other.booking_id, run_id=run["run_id"]
    )
    assert env["error"]["code"] == "run_not_found"
    own_ref = api.ref("cancel", run_id=run["run_id"])
    r = api.client.post(
        f"/v1/runs/{run['run_id']}/cancel",
        json={"confirmation_ref": own_ref},
        headers=api.h(other.submitter, "other-cancel-1"),
    )
    assert r.status_code == 404 and code_of(r) == "run_not_found"
    assert api.store.get_run(run["run_id"])["state"] == "accepted"
