"""Every gate failure mode of POST /v1/runs (and friends), each with its own code.

In-process app over a real SQLite file; the upstream booking service is replaced by
the registry the admin CLI feeds (it cannot exist here)."""

from __future__ import annotations

import json
import time

import pytest
from helpers.fixtures import both_engines
from helpers.manifests import manifest_payload
from helpers.tenants import add_key, booking_doc, iso_in, make_tenant

from orchestrator.gates.bookings import BookingFile, add_booking, parse_iso
from orchestrator.gates.confirmations import ref_hash
from stages.errors import ItoError

from .conftest import Api, code_of

# The contract holds on both engines: SQLite (embedded) and PostgreSQL (replicas).
pytestmark = both_engines


def _runs(api: Api) -> int:
    return int(api.store.read("SELECT COUNT(*) AS n FROM runs")[0]["n"])


def _consumed(api: Api, ref: str) -> bool:
    row = api.store.read_one(
        "SELECT consumed_at FROM confirmations WHERE ref_sha256 = ?", (ref_hash(ref),)
    )
    return row is not None and row["consumed_at"] is not None


# --- happy path and replays -----------------------------------------------------------
def test_submit_creates_one_accepted_run_and_replays(api: Api) -> None:
    m = api.manifest()
    ref = api.ref(manifest=m)
    first = api.submit(manifest=m, ref=ref, idem="key-happy-1")
    assert first.status_code == 200
    run = first.json()["data"]
    assert run["state"] == "accepted" and run["replayed"] is False
    assert run["manifest_id"] == "mf_" + run["manifest_digest"][:24]
    again = api.submit(manifest=m, ref=ref, idem="key-happy-1").json()
    assert again["data"]["run_id"] == run["run_id"] and again["data"]["replayed"] is True
    assert _runs(api) == 1
    found = api.client.get(
        "/v1/runs", params={"idempotency_key": "key-happy-1"}, headers=api.h(api.t.submitter)
    ).json()
    assert [r["run_id"] for r in found["data"]["runs"]] == [run["run_id"]]


def test_same_key_different_request_is_conflict(api: Api) -> None:
    api.run(idem="key-conflict")
    other = api.manifest(name="other")
    r = api.submit(manifest=other, idem="key-conflict")
    assert r.status_code == 409 and code_of(r) == "idempotency_conflict"
    assert _runs(api) == 1


@pytest.mark.parametrize(
    "idem, code",
    [
        (None, "idempotency_key_missing"),
        ("short", "idempotency_key_invalid"),
        ("bad key with spaces!", "idempotency_key_invalid"),
    ],
)
def test_idempotency_key_required_and_well_formed(api: Api, idem: str | None, code: str) -> None:
    m = api.manifest()
    ref = api.ref(manifest=m)
    r = api.client.post(
        "/v1/runs",
        json={"booking_id": api.t.booking_id, "confirmation_ref": ref, **manifest_payload(m)},
        headers=api.h(api.t.submitter, idem),
    )
    assert code_of(r) == code and not _consumed(api, ref)


# --- auth ----------------------------------------------------------------------------
def test_auth_failures(api: Api) -> None:
    r = api.client.get(f"/v1/bookings/{api.t.booking_id}/eligibility")
    assert r.status_code == 401 and code_of(r) == "unauthenticated"
    r = api.client.get(
        f"/v1/bookings/{api.t.booking_id}/eligibility", headers=api.h("itok_0000_not-a-real-key")
    )
    assert code_of(r) == "unauthenticated"
    # The approver cannot submit (no runs:write): authentication is not authority.
    assert code_of(api.submit(key=api.t.approver)) == "forbidden_scope"
    # The submitter cannot confirm.
    env = api.confirm(key=api.t.submitter)
    assert env["error"]["code"] == "forbidden_scope"
    api.store.revoke_key(api.t.key_ids["submitter"])
    r = api.submit()
    assert r.status_code == 401 and code_of(r) == "credential_revoked"


def test_other_tenant_sees_run_not_found(api: Api) -> None:
    run = api.run()
    other = make_tenant(api.db, "globex")
    for path in ("", "/logs", "/metrics", "/checkpoints"):
        r = api.client.get(f"/v1/runs/{run['run_id']}{path}", headers=api.h(other.submitter))
        assert r.status_code == 404 and code_of(r) == "run_not_found"
    r = api.client.get(
        "/v1/runs", params={"idempotency_key": "key-0000001"}, headers=api.h(other.submitter)
    )
    assert r.json()["data"]["runs"] == []


# --- booking eligibility -------------------------------------------------------------
def _booking(api: Api, booking_id: str, **over: object) -> str:
    add_booking(api.store, BookingFile.model_validate(booking_doc(booking_id, "acme", **over)))
    return booking_id


@pytest.mark.parametrize(
    "setup, code",
    [
        (lambda api: "bk-unknown", "booking_not_found"),
        (
            lambda api: _booking(api, "bk-old", term_start=iso_in(-48), term_end=iso_in(-1)),
            "booking_expired",
        ),
        (
            lambda api: _booking(api, "bk-future", term_start=iso_in(2), term_end=iso_in(30)),
            "booking_not_started",
        ),
        (lambda api: _booking(api, "bk-nofabric", fabric=None), "booking_incomplete"),
        (
            lambda api: _booking(api, "bk-nosku", gpu_sku=None, gpus_per_node=None),
            "booking_incomplete",
        ),
    ],
)
def test_booking_fails_closed(api: Api, setup, code: str) -> None:  # type: ignore[no-untyped-def]
    booking_id = setup(api)
    r = api.client.get(f"/v1/bookings/{booking_id}/eligibility", headers=api.h(api.t.submitter))
    assert code_of(r) == code
    # The submit is refused at the same gate, and nothing is created.
    ref = api.ref()  # a valid train confirmation for the good booking
    assert code_of(api.submit(booking_id=booking_id, ref=ref)) == code
    assert _runs(api) == 0 and not _consumed(api, ref)


@pytest.mark.parametrize(
    "state, code", [("revoked", "booking_revoked"), ("released", "booking_released")]
)
def test_revoked_and_released_bookings(api: Api, state: str, code: str) -> None:
    ref = api.ref()
    api.store.set_booking_state(api.t.booking_id, state)
    assert (
        code_of(
            api.client.get(
                f"/v1/bookings/{api.t.booking_id}/eligibility", headers=api.h(api.t.submitter)
            )
        )
        == code
    )
    assert code_of(api.submit(ref=ref)) == code and _runs(api) == 0


def test_other_accounts_booking_answers_as_a_missing_one(api: Api) -> None:
    other = make_tenant(api.db, "globex")
    h = api.h(api.t.submitter)
    theirs = api.client.get(f"/v1/bookings/{other.booking_id}/eligibility", headers=h)
    missing = api.client.get("/v1/bookings/bk-globey/eligibility", headers=h)
    assert theirs.status_code == missing.status_code == 404
    assert code_of(theirs) == code_of(missing) == "booking_not_found"

    def strip(r):
        return (
            r.json()["error"]["message"].replace(other.booking_id, "ID").replace("bk-globey", "ID")
        )

    assert strip(theirs) == strip(missing)
    # The same for a confirmation naming it.
    body = {"action": "cancel", "booking_id": other.booking_id, "run_id": "run_x", "cost_usd": 0}
    r = api.client.post("/v1/confirmations", json=body, headers=api.h(api.t.approver))
    assert r.status_code == 404 and code_of(r) == "booking_not_found"


def test_eligibility_is_fresh_and_bound(api: Api) -> None:
    d = api.client.get(
        f"/v1/bookings/{api.t.booking_id}/eligibility", headers=api.h(api.t.submitter)
    ).json()["data"]
    assert d["eligible"] is True and d["account"] == "acme"
    assert {
        "gpu_sku",
        "gpus_per_node",
        "node_count",
        "region",
        "fabric",
        "term_start",
        "term_end",
        "checked_at",
        "valid_until",
    } <= set(d)
    assert d["checked_at"] < d["valid_until"] <= d["term_end"]


# --- manifest ------------------------------------------------------------------------
def test_manifest_failures(api: Api) -> None:
    m = api.manifest()
    ref = api.ref(manifest=m)
    payload = manifest_payload(m)
    body = {"booking_id": api.t.booking_id, "confirmation_ref": ref, **payload}
    bad_digest = {**body, "manifest_digest": "0" * 64}
    r = api.client.post("/v1/runs", json=bad_digest, headers=api.h(api.t.submitter, "k-dig-001"))
    assert code_of(r) == "manifest_digest_mismatch"
    extra = api.manifest()
    extra["surprise"] = 1
    r = api.submit(manifest=extra, ref=ref, idem="k-extra-01")
    assert code_of(r) == "manifest_invalid"
    assert not _consumed(api, ref) and _runs(api) == 0


def test_manifest_secret_refused_everywhere(api: Api) -> None:
    m = api.manifest()
    m["data"]["refs"][0]["uri"] = "file://alice:hunter2@host/data.jsonl"
    env = api.confirm(manifest=m)
    assert env["error"]["code"] == "manifest_contains_secret"
    assert "hunter2" not in str(env)
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(m)},
        headers=api.h(api.t.submitter),
    )
    assert code_of(r) == "manifest_contains_secret" and "hunter2" not in r.text


# --- confirmation --------------------------------------------------------------------
def test_confirmation_required_and_unknown(api: Api) -> None:
    assert code_of(api.submit(ref="")) == "confirmation_required"
    assert (
        code_of(api.submit(ref="itoc_" + "A" * 43, idem="key-unknown")) == "confirmation_not_found"
    )


def test_confirmation_replay_is_refused(api: Api) -> None:
    m = api.manifest()
    ref = api.ref(manifest=m)
    api.run(manifest=m, ref=ref, idem="key-first-1")
    r = api.submit(manifest=m, ref=ref, idem="key-second-1")
    assert r.status_code == 409 and code_of(r) == "confirmation_consumed"
    assert _runs(api) == 1


def test_confirmation_expired(api: Api) -> None:
    ref = api.ref()
    # Simulate the clock passing the expiry (no sleeping in tests).
    with api.store.tx() as c:
        c.execute("UPDATE confirmations SET expires_at = ?", (time.time() - 1,))
    assert code_of(api.submit(ref=ref)) == "confirmation_expired"


def test_confirmation_bindings(api: Api) -> None:
    m = api.manifest()
    # other account: globex's approver confirms for globex; acme cannot use it.
    other = make_tenant(api.db, "globex")
    other_ref = api.ref(manifest=m, key=other.approver, booking_id=other.booking_id)
    assert code_of(api.submit(manifest=m, ref=other_ref)) == "confirmation_account_mismatch"
    # other action: a release confirmation is not a train confirmation.
    rel = api.ref("release")
    assert (
        code_of(api.submit(manifest=m, ref=rel, idem="key-act-01"))
        == "confirmation_action_mismatch"
    )
    # other booking of the same account.
    _booking(api, "bk-second")
    ref2 = api.ref(manifest=m, booking_id="bk-second")
    assert (
        code_of(api.submit(manifest=m, ref=ref2, idem="key-bk-001"))
        == "confirmation_booking_mismatch"
    )
    # other digest: confirmed one manifest, submitted another (file swapped).
    ref3 = api.ref(manifest=m)
    swapped = api.manifest(name="swapped")
    assert (
        code_of(api.submit(manifest=swapped, ref=ref3, idem="key-dig-01"))
        == "confirmation_digest_mismatch"
    )
    # higher cost: confirmed $0.0000001 but the estimate is higher.
    big = api.manifest(
        training={"target_tokens": 10_000_000_000, "seq_len": 64, "global_batch_tokens": 512}
    )
    big["budget"] = {"ceiling_usd": 1e6, "max_incremental_cost_usd": 1e6}
    ref4 = api.ref(manifest=big, cost_usd=0.0)
    r = api.submit(manifest=big, ref=ref4, idem="key-cost-1")
    assert code_of(r) == "confirmation_cost_exceeded" and not _consumed(api, ref4)
    assert _runs(api) == 0


def test_confirmation_run_mismatch_and_ttl(api: Api) -> None:
    a = api.run(idem="key-run-a1")
    b = api.run(idem="key-run-b1")
    ref = api.ref("cancel", run_id=a["run_id"])
    r = api.client.post(
        f"/v1/runs/{b['run_id']}/cancel",
        json={"confirmation_ref": ref},
        headers=api.h(api.t.submitter, "key-cancel-b"),
    )
    assert code_of(r) == "confirmation_run_mismatch"
    assert api.confirm(ttl_s=901)["error"]["code"] == "confirmation_ttl_invalid"
    assert api.confirm(ttl_s=0)["error"]["code"] == "confirmation_ttl_invalid"
    ok = api.confirm(ttl_s=900)
    assert ok["ok"] and ok["data"]["confirmation_ref"].startswith("itoc_")


def test_confirmation_ref_stored_hashed(api: Api) -> None:
    ref = api.ref()
    rows = api.store.read("SELECT * FROM confirmations")
    assert rows and all(ref not in str(r) for r in rows)
    assert rows[0]["ref_sha256"] == ref_hash(ref)


# --- server-side validation ----------------------------------------------------------
def _v(api: Api, **sections: object) -> dict:
    return api.manifest(**sections)


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda api, m: m["model"].update(preset="llama-nope"), "model_preset_unknown"),
        (lambda api, m: m["model"].update(preset="llama\u0000tiny"), "model_preset_unknown"),
        (
            lambda api, m: m["data"]["refs"][0].update(uri="http://[::1/data"),
            "data_scheme_not_allowed",
        ),
        (
            lambda api, m: m["model"].update(preset="llama3-405b", size="405B"),
            "capacity_insufficient",
        ),
        (
            lambda api, m: m["data"]["refs"][0].update(uri="s3://bucket/data.jsonl"),
            "data_scheme_not_allowed",
        ),
        (lambda api, m: m["data"]["refs"][0].pop("provenance"), "data_provenance_missing"),
        (
            lambda api, m: m["checkpoint"].update(storage_uri="file:///tmp/../etc/ckpt"),
            "checkpoint_storage_invalid",
        ),
        (
            lambda api, m: m["checkpoint"].update(storage_uri="file:///proc/ito-ckpt"),
            "path_outside_root",
        ),
        # Beyond what any real run uses: refused by the schema's bounds, before any math.
        (lambda api, m: m["training"].update(max_steps=10**400), "manifest_invalid"),
        (
            lambda api, m: m.update(
                model={"preset": "llama-1b", "size": "1B"},
                training={"target_tokens": 10**11, "seq_len": 64, "global_batch_tokens": 512},
            ),
            "budget_exceeded",
        ),
    ],
)
def test_validation_failures(api: Api, mutate, code: str) -> None:  # type: ignore[no-untyped-def]
    m = api.manifest()
    mutate(api, m)
    if code in ("data_provenance_missing", "manifest_invalid"):
        # Refused at the manifest gate already; the approver cannot even confirm it.
        assert api.confirm(manifest=m)["error"]["code"] == code
        return
    ref = api.ref(manifest=m, cost_usd=1e9)
    r = api.submit(manifest=m, ref=ref, idem="key-valid-1")
    assert code_of(r) == code
    assert _runs(api) == 0 and not _consumed(api, ref), "validation must not consume"
    plan = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(m)},
        headers=api.h(api.t.submitter),
    )
    assert code_of(plan) == code


def test_unknown_fabric_and_sku_are_refused_at_registration(api: Api) -> None:
    for over, code in (
        ({"fabric": "token-ring"}, "fabric_unknown"),
        ({"gpu_sku": "Z9000"}, "gpu_sku_unknown"),
    ):
        with pytest.raises(ItoError) as e:
            _booking(api, "bk-unknown", **over)
        assert e.value.code == code
    assert api.store.booking("bk-unknown") is None


def test_upstream_spellings_of_sku_and_fabric_are_stored_as_profile_names(api: Api) -> None:
    for i, (fabric, sku) in enumerate(
        (
            ("infiniband-ndr", "NVIDIA H100 80GB HBM3"),
            ("InfiniBand NDR", "h100 sxm5"),
            ("IB_NDR", "H100-SXM"),
        )
    ):
        row = api.store.booking(_booking(api, f"bk-alias-{i}", fabric=fabric, gpu_sku=sku))
        assert row is not None
        assert (row["fabric"], row["gpu_sku"]) == ("ib-ndr", "H100-SXM")


def test_unknown_fabric_and_sku(api: Api) -> None:
    # Registration refuses them now; the gate still does, for a booking registered
    # before its profile was removed from configs/ (written to the store directly).
    for booking_id, over in (
        ("bk-fabric", {"fabric": "token-ring"}),
        ("bk-sku", {"gpu_sku": "Z9000"}),
    ):
        doc = BookingFile.model_validate(booking_doc(booking_id, "acme", **over))
        row = doc.model_dump()
        row.update(
            account_id=api.store.account_by_name("acme")["account_id"],
            term_start=parse_iso(doc.term_start),
            term_end=parse_iso(doc.term_end),
        )
        api.store.add_booking(row)
    for booking_id, code in (("bk-fabric", "fabric_unknown"), ("bk-sku", "gpu_sku_unknown")):
        m = api.manifest()
        ref = api.ref(manifest=m, booking_id=booking_id)
        r = api.submit(manifest=m, ref=ref, booking_id=booking_id, idem=f"key-{booking_id}")
        assert code_of(r) == code and not _consumed(api, ref)


def test_incremental_cost(api: Api) -> None:
    # A booking ending in 1 h and a run estimated at ~3.5 h on 8 H100s.
    _booking(api, "bk-short", term_end=iso_in(1))
    m = api.manifest(
        model={"preset": "llama-1b", "size": "1B"},
        training={
            "target_tokens": 2_000_000_000 * 8,
            "seq_len": 512,
            "global_batch_tokens": 524288,
        },
        budget={"ceiling_usd": 1e6, "max_incremental_cost_usd": 1.0},
    )
    ref = api.ref(manifest=m, booking_id="bk-short", cost_usd=1e6)
    r = api.submit(manifest=m, ref=ref, booking_id="bk-short")
    assert code_of(r) == "incremental_cost_exceeded" and _runs(api) == 0


# --- plans ---------------------------------------------------------------------------
def test_plan_creates_nothing(api: Api) -> None:
    m = api.manifest()
    ref = api.ref(manifest=m)
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(m)},
        headers=api.h(api.t.submitter, "key-plan-01"),
    )
    d = r.json()["data"]
    assert r.status_code == 200 and d["manifest_id"].startswith("mf_")
    assert d["validation"]["capacity"]["gpus"] == 8 and d["cost_estimate_usd"] >= 0
    assert _runs(api) == 0 and not _consumed(api, ref)
    assert api.store.read("SELECT * FROM idempotency") == []
    # The key given to plan is not reserved: a submit with it succeeds.
    assert api.submit(manifest=m, ref=ref, idem="key-plan-01").status_code == 200


def test_confirmation_needs_approver_scope_per_action(api: Api) -> None:
    _, only_train = add_key(api.db, "acme", ("confirm:train",))
    assert api.confirm("release", key=only_train)["error"]["code"] == "forbidden_scope"
    assert api.confirm("train", key=only_train)["ok"] is True


def test_gate_decisions_are_audited(api: Api) -> None:
    api.run()
    api.submit(ref="itoc_nope-nope-nope", idem="key-audit-2")
    rows = api.store.read("SELECT gate, outcome, code FROM audit_events WHERE action='train'")
    gates = [(r["gate"], r["outcome"]) for r in rows]
    for gate in ("auth", "booking", "manifest", "confirmation", "validation", "commit"):
        assert (gate, "pass") in gates
    assert ("confirmation", "fail") in gates
    assert any(r["code"] == "confirmation_not_found" for r in rows)


def test_oversized_manifest(api: Api) -> None:
    raw = json.dumps(api.manifest()).encode() + b" " * (1 << 20)  # > 1 MiB cap, valid JSON
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(raw)},
        headers=api.h(api.t.submitter),
    )
    assert r.status_code == 413 and code_of(r) == "manifest_too_large"


def test_a_key_cannot_approve_its_own_submit(api: Api) -> None:
    """Authentication is identity, not authority: one key holding both the confirm and
    the write scope still cannot confirm for itself."""
    from helpers.tenants import add_key

    _, both = add_key(api.db, "acme", ("runs:read", "runs:write", "confirm:train"))
    m = api.manifest()
    ref = api.ref(manifest=m, key=both)
    r = api.submit(manifest=m, ref=ref, idem="key-self-1", key=both)
    assert code_of(r) == "confirmation_self_approved"
    assert not _consumed(api, ref) and _runs(api) == 0
    assert api.submit(manifest=m, ref=ref, idem="key-self-2").json()["ok"]  # the submitter may
