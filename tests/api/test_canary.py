"""A canary secret planted in the server's environment and in refused manifests appears
in no response, no log line and no byte of the database files."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from helpers.backend import start_backend
from helpers.flows import confirm, submit
from helpers.manifests import example_manifest, manifest_payload
from helpers.tenants import make_tenant

from orchestrator.db.store import Store


@pytest.mark.slow
def test_canary_secret_is_echoed_nowhere(tmp_path: Path) -> None:
    canary = "sk-canary" + secrets.token_hex(16)
    backend = start_backend(
        tmp_path / "b", env={"ITO_CANARY_TOKEN": canary, "OPENAI_API_KEY": canary}
    )
    bodies: list[str] = []
    try:
        t = make_tenant(backend.db, "acme")
        base = example_manifest(tmp_path / "ckpt")
        plants = []
        m = example_manifest(tmp_path / "ckpt")
        m["data"]["refs"][0]["provenance"]["source"] = f"scraped with key {canary}"
        plants.append(m)
        m = example_manifest(tmp_path / "ckpt")
        m["data"]["refs"][0]["uri"] = f"file://bob:{canary}@localhost/data.jsonl"
        plants.append(m)
        m = example_manifest(tmp_path / "ckpt")
        m["data"]["refs"][0]["password"] = canary
        plants.append(m)
        m = example_manifest(tmp_path / "ckpt")
        m[canary] = 1  # the secret as a key name
        plants.append(m)
        with backend.client() as c:
            good_ref = confirm(c, t.approver, "train", t.booking_id, manifest=base)
            bodies.append(str(good_ref))
            for i, planted in enumerate(plants):
                env = confirm(c, t.approver, "train", t.booking_id, manifest=planted)
                assert env["error"]["code"] == "manifest_contains_secret", env
                bodies.append(str(env))
                r = c.post(
                    "/v1/plans",
                    json={"booking_id": t.booking_id, **manifest_payload(planted)},
                    headers={"Authorization": f"Bearer {t.submitter}"},
                )
                bodies.append(r.text)
                r = submit(
                    c,
                    t.submitter,
                    t.booking_id,
                    planted,
                    good_ref["data"]["confirmation_ref"],
                    f"canary-key-{i}",
                )
                assert r.json()["error"]["code"] == "manifest_contains_secret"
                bodies.append(r.text)
            # The canary as an idempotency key (refused as invalid, echoed nowhere) and
            # as a booking id.
            r = submit(
                c, t.submitter, t.booking_id, base, good_ref["data"]["confirmation_ref"], canary
            )
            assert r.json()["error"]["code"] == "idempotency_key_invalid", r.text
            bodies.append(r.text)
            r = c.get(
                f"/v1/bookings/{canary}/eligibility",
                headers={"Authorization": f"Bearer {t.submitter}"},
            )
            bodies.append(r.text)
            # ... as an idempotency key sent for real (header and the find query), and
            # as a run id in a URL path: all of them reach the access log's URL.
            r = submit(
                c, t.submitter, t.booking_id, base, good_ref["data"]["confirmation_ref"], canary
            )
            bodies.append(r.text)
            for url in (
                f"/v1/runs?idempotency_key={canary}",
                f"/v1/runs/{canary}",
                f"/v1/runs/{canary}/logs?cursor=0",
            ):
                bodies.append(c.get(url, headers={"Authorization": f"Bearer {t.submitter}"}).text)
    finally:
        backend.stop()
    for text in bodies:
        assert canary not in text
    # The server's log, access log included (its URLs are redacted).
    log = backend.log_text()
    assert "GET /v1/runs/{id} HTTP/1.1" in log  # the access log is on and was searched
    assert canary not in log
    store = Store(backend.db)
    try:
        tables = [
            r["name"] for r in store.read("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        for table in tables:
            for row in store.read(f"SELECT * FROM {table}"):
                assert canary not in str(row), table
        audit = store.read("SELECT * FROM audit_events WHERE code = 'manifest_contains_secret'")
        assert len(audit) >= 3 * len(plants)
    finally:
        store.close()
    for f in backend.db.parent.glob("ito.db*"):
        assert canary.encode() not in f.read_bytes(), f.name
