"""``ito-backend`` admin commands as real subprocesses (the operator's path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.tenants import add_booking_cli, admin, booking_doc

from orchestrator.db.store import Store
from orchestrator.gates.auth import authenticate, sha256_hex
from stages.errors import ErrorCode, ItoError


@pytest.mark.slow
def test_accounts_keys_bookings(tmp_path: Path) -> None:
    db = tmp_path / "ito.db"
    env = admin(db, "accounts", "create", "acme")
    assert env["ok"] and env["live_api_contacted"] is False
    assert admin(db, "accounts", "create", "acme", check=False)["ok"] is False
    issued = admin(
        db,
        "keys",
        "issue",
        "--account",
        "acme",
        "--scope",
        "runs:read",
        "--scope",
        "runs:write,confirm:train",
    )["data"]
    key = issued["api_key"]
    assert key.startswith("itok_") and issued["scopes"] == [
        "confirm:train",
        "runs:read",
        "runs:write",
    ]
    assert (
        admin(db, "keys", "issue", "--account", "acme", "--scope", "root", check=False)["error"][
            "code"
        ]
        == "bad_request"
    )
    store = Store(db)
    # Stored only as a hash: the key appears in no row.
    rows = store.read("SELECT * FROM api_keys")
    assert all(key not in json.dumps(r) for r in rows)
    assert rows[0]["key_sha256"] == sha256_hex(key)
    assert authenticate(store, f"Bearer {key}").scopes == {
        "runs:read",
        "runs:write",
        "confirm:train",
    }
    admin(db, "keys", "revoke", issued["key_id"])
    with pytest.raises(ItoError) as e:
        authenticate(store, f"Bearer {key}")
    assert e.value.code == ErrorCode.credential_revoked

    doc = booking_doc("bk-1", "acme")
    view = add_booking_cli(db, tmp_path, doc)["data"]
    assert view["state"] == "active" and view["gpus_per_node"] == 8
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps(doc))
    assert admin(db, "bookings", "add", str(dup), check=False)["error"]["code"] == "booking_exists"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "booking_id": "bk-2", "surprise": 1}))
    assert (
        admin(db, "bookings", "add", str(bad), check=False)["error"]["code"] == "validation_error"
    )
    assert admin(db, "bookings", "revoke", "bk-1")["data"]["state"] == "revoked"
    assert admin(db, "bookings", "release", "bk-1")["data"]["state"] == "released"
    assert (
        admin(db, "bookings", "release", "bk-nope", check=False)["error"]["code"]
        == "booking_not_found"
    )
    actions = {r["action"] for r in store.read("SELECT action FROM audit_events")}
    assert {
        "admin:accounts.create",
        "admin:keys.issue",
        "admin:keys.revoke",
        "admin:bookings.add",
        "admin:bookings.revoked",
        "admin:bookings.released",
    } <= actions
    store.close()


@pytest.mark.slow
def test_accounts_roots_and_disable(tmp_path: Path) -> None:
    """The operator confines an account to its roots, then disables it."""
    db = tmp_path / "ito.db"
    admin(db, "accounts", "create", "acme")
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    data.mkdir()
    ckpt.mkdir()
    env = admin(db, "accounts", "roots", "acme", "--data", str(data), "--checkpoint", str(ckpt))
    assert env["data"]["data_roots"] == [str(data)]
    assert env["data"]["checkpoint_roots"] == [str(ckpt)]
    for bad in ("relative/dir", f"{data}/../ckpt", str(tmp_path / "missing")):
        assert (
            admin(db, "accounts", "roots", "acme", "--data", bad, check=False)["error"]["code"]
            == "bad_request"
        ), bad
    key = admin(db, "keys", "issue", "--account", "acme", "--scope", "runs:read")["data"]
    store = Store(db)
    assert authenticate(store, f"Bearer {key['api_key']}").account_id
    assert admin(db, "accounts", "disable", "acme")["data"]["disabled"] is True
    with pytest.raises(ItoError) as e:
        authenticate(store, f"Bearer {key['api_key']}")
    assert e.value.code == ErrorCode.account_disabled
    assert admin(db, "accounts", "disable", "acme", check=False)["ok"] is False
    assert admin(db, "accounts", "disable", "nobody", check=False)["ok"] is False
    store.close()
