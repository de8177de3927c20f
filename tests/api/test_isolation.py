"""Tenants reach only what is theirs, in process: real SQLite, real gates,
real files and symlinks; each test is an attack that succeeded on the old code.

What a refusal may say is checked on every channel a tenant or a log reader sees: the
response, the audit rows, the server's log records and the stage's events.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.flows import confirm_ref, submit
from helpers.manifests import example_manifest, manifest_payload
from helpers.tenants import Tenant, make_tenant

from orchestrator.api import create_app
from orchestrator.db.store import Store
from orchestrator.settings import Settings
from stages.base import StageContext
from stages.data_prep import DataPrepStage
from stages.data_prep.config import DataPrepConfig
from stages.events import Event

SECRET_TEXT = b"root:CANARY-HASH:19000:0:99999:7:::\n"
# Narrow bounds keep the flood test short; the defaults are in Settings.
FAIL_BURST = 5
# One audit window longer than any flood here, however slow the machine: the counted
# rows do not depend on how many windows the flood happened to span.
AUDIT_WINDOW_S = 3600.0


@dataclass
class World:
    client: TestClient
    tmp: Path
    t: Tenant
    other: Tenant
    store: Store
    settings: Settings
    data_root: Path
    ckpt_root: Path
    secret: Path

    def h(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.t.submitter}"}

    def manifest(self, uri: str | None = None, **data: Any) -> dict[str, Any]:
        m = example_manifest(self.ckpt_root / "run")
        if uri is not None:
            m["data"]["refs"][0]["uri"] = uri
        m["data"].update(data)
        return m

    def plan(self, m: dict[str, Any]) -> httpx.Response:
        r: httpx.Response = self.client.post(
            "/v1/plans",
            json={"booking_id": self.t.booking_id, **manifest_payload(m)},
            headers=self.h(),
        )
        return r


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    db = tmp_path / "ito.db"
    data_root, ckpt_root = tmp_path / "acme-data", tmp_path / "acme-ckpt"
    data_root.mkdir()
    ckpt_root.mkdir()
    (data_root / "train.jsonl").write_text('{"text": "hello"}\n')
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET_TEXT)
    settings = Settings(
        db_path=db,
        var_dir=tmp_path / "var",
        planner_gate=False,
        metrics_port=0,
        metrics_token="scrape-token-0123456789",
        rate_auth_fail_burst=FAIL_BURST,
        rate_auth_fail_per_s=0.01,
        auth_fail_audit_window_s=AUDIT_WINDOW_S,
    )
    t = make_tenant(db, "acme", data_roots=(str(data_root),), checkpoint_roots=(str(ckpt_root),))
    other = make_tenant(db, "globex")
    store = Store(db)
    with TestClient(create_app(settings)) as client:
        yield World(client, tmp_path, t, other, store, settings, data_root, ckpt_root, secret)
    store.close()


def _leaks(text: str, *paths: str | Path) -> list[str]:
    """What a refusal must never carry: the path, a digest prefix of the target, or
    words about existence."""
    found = [str(p) for p in paths if str(p) in text]
    for p in paths:
        if Path(p).is_file():
            try:
                digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            except OSError:
                continue
            if digest[:12] in text:
                found.append("digest")
    found += [w for w in ("exist", "No such", "not found", "Permission") if w in text]
    return found


def _attacks(w: World) -> dict[str, str]:
    """Every way out of the data root that was tried, as data.refs[0].uri."""
    (w.data_root / "link").symlink_to(w.secret)
    (w.data_root / "dirlink").symlink_to(w.tmp)
    (w.data_root / "folder").mkdir()
    (w.data_root / "folder" / "a.jsonl").write_text('{"text": "x"}\n')
    (w.data_root / "folder" / "b.jsonl").symlink_to(w.secret)
    other_run = w.settings.var_dir / "runs" / "run_globex01" / "data_prep"
    other_run.mkdir(parents=True)
    (other_run / "clean.jsonl").write_text('{"text": "globex private"}\n')
    return {
        "absolute": f"file://{w.secret}",
        "etc_shadow": "file:///etc/shadow",
        "missing_outside": "file:///etc/ito-no-such-file",
        "dotdot": f"file://{w.data_root}/../shadow",
        "dotdot_encoded": f"file://{w.data_root}/%2E%2E/shadow",
        "symlink_file": f"file://{w.data_root}/link",
        "symlink_dir": f"file://{w.data_root}/dirlink/shadow",
        "symlink_in_folder": f"file://{w.data_root}/folder",
        "other_host": f"file://evil.example{w.secret}",
        "other_tenant_run": f"file://{other_run}/clean.jsonl",
        "server_db": f"file://{w.settings.db_path}",
        "proc_self": "file:///proc/self/environ",
    }


def test_every_file_read_attempt_is_refused_with_one_code_and_no_leak(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    w = world
    attacks = _attacks(w)
    # An operator mistake: a root that also holds the server's own files. Those stay
    # out of reach anyway (database, run scratch space).
    w.store.set_roots(
        w.store.account_by_name("acme")["account_id"], "data", [str(w.data_root), str(w.tmp)]
    )
    caplog.set_level(logging.DEBUG)
    messages = {}
    for name, uri in attacks.items():
        if name in ("absolute", "dotdot", "symlink_dir", "symlink_in_folder"):
            continue  # inside the broad root by design of this step; checked below
        r = w.plan(w.manifest(uri))
        assert r.status_code == 422, (name, r.text)
        assert r.json()["error"]["code"] == "path_outside_root", (name, r.text)
        messages[name] = r.json()["error"]["message"]
        assert not _leaks(r.text, uri.removeprefix("file://"), w.secret, w.tmp), name
    # Existence is not told: a file that exists and one that does not answer alike.
    assert messages["etc_shadow"] == messages["missing_outside"]
    # Narrow roots again: everything outside, through any trick, is refused.
    w.store.set_roots(w.store.account_by_name("acme")["account_id"], "data", [str(w.data_root)])
    for name in (
        "absolute",
        "dotdot",
        "dotdot_encoded",
        "symlink_file",
        "symlink_dir",
        "symlink_in_folder",
        "other_tenant_run",
    ):
        r = w.plan(w.manifest(attacks[name]))
        assert r.status_code == 422, (name, r.text[:600])
        assert r.json()["error"]["code"] == "path_outside_root", name
        assert not _leaks(r.text, w.secret, w.tmp), name
    # The audit rows and the server's log carry no path and no digest either.
    audit = json.dumps(w.store.audit_events())
    assert not _leaks(audit, w.secret, w.tmp)
    assert not _leaks(caplog.text, w.secret, str(w.tmp) + "/shadow")
    # The ref inside the root is fine.
    ok = w.plan(w.manifest(f"file://{w.data_root}/train.jsonl"))
    assert ok.status_code == 200, ok.text


def test_the_run_checks_again_with_the_same_walk(world: World, tmp_path: Path) -> None:
    """The data-prep stage resolves refs inside the roots at run time too (a symlink
    swapped in after submit is refused), and says nothing about the target."""
    w = world
    attacks = _attacks(w)
    for name in (
        "absolute",
        "symlink_file",
        "symlink_dir",
        "symlink_in_folder",
        "dotdot",
        "other_host",
        "other_tenant_run",
    ):
        cfg = DataPrepConfig.model_validate(w.manifest(attacks[name])["data"])
        events: list[Event] = []
        ctx = StageContext(
            run_id="run-1", booking_id="bk-1", workdir=tmp_path / name, emit=events.append
        )
        out = DataPrepStage(cfg, data_roots=(str(w.data_root),)).run(ctx)
        assert out.status == "failed" and out.error_code == "path_outside_root", (name, out)
        seen = out.reason + json.dumps([e.model_dump(mode="json") for e in events])
        assert not _leaks(seen, w.secret, w.tmp / "var"), (name, seen)
    # Eval files and the cache folder are held to the same roots.
    m = w.manifest(f"file://{w.data_root}/train.jsonl", eval_files=[f"file://{w.secret}"])
    m["data"]["refs"][0]["sha256"] = hashlib.sha256(
        (w.data_root / "train.jsonl").read_bytes()
    ).hexdigest()
    cfg = DataPrepConfig.model_validate(m["data"])
    out = DataPrepStage(cfg, data_roots=(str(w.data_root),)).run(
        StageContext(run_id="run-1", booking_id="bk-1", workdir=tmp_path / "ev")
    )
    assert out.error_code == "path_outside_root"


def test_cache_dir_and_eval_files_outside_the_roots_are_refused_at_plan(world: World) -> None:
    w = world
    ok_uri = f"file://{w.data_root}/train.jsonl"
    for data in ({"eval_files": [f"file://{w.secret}"]}, {"cache_dir": str(w.tmp)}):
        r = w.plan(w.manifest(ok_uri, **data))
        assert r.json()["error"]["code"] == "path_outside_root", r.text
        assert str(w.secret) not in r.text and str(w.tmp) not in r.text


def test_checkpoint_storage_needs_a_root_and_plan_writes_nothing(world: World) -> None:
    w = world
    ok_uri = f"file://{w.data_root}/train.jsonl"
    escape = w.ckpt_root / "escape"
    escape.symlink_to("/etc")
    for storage in (f"file://{escape}/ckpt", "file:///etc/ito-ckpt", f"file://{w.tmp}/x"):
        m = w.manifest(ok_uri)
        m["checkpoint"]["storage_uri"] = storage
        r = w.plan(m)
        assert r.json()["error"]["code"] == "path_outside_root", (storage, r.text)
        assert "/etc" not in r.json()["error"]["message"]
    before = sorted(p.name for p in w.ckpt_root.iterdir())
    r = w.plan(w.manifest(ok_uri))
    assert r.status_code == 200 and r.json()["data"]["validation"]["checkpoint_storage"]
    assert sorted(p.name for p in w.ckpt_root.iterdir()) == before  # no probe, no folder
    assert not any(p.name.startswith(".ito-probe") for p in Path("/etc").iterdir())
    # globex has roots under the temp folder, acme's folder is not in them by default?
    # An account without checkpoint roots can use none.
    w.store.set_roots(w.store.account_by_name("acme")["account_id"], "checkpoint", [])
    assert w.plan(w.manifest(ok_uri)).json()["error"]["code"] == "path_outside_root"


@pytest.mark.parametrize(
    "data, code",
    [
        ({"eval_suites": ["../../../etc/passwd"]}, "eval_suite_unknown"),
        ({"eval_suites": ["gsm8k", "nope"]}, "eval_suite_unknown"),
        (
            {"ladder_probe": {"enabled": True, "rung_preset": "../../../etc/passwd"}},
            "model_preset_unknown",
        ),
        ({"ladder_probe": {"enabled": True, "rung_preset": "llama-nope"}}, "model_preset_unknown"),
    ],
)
def test_names_that_pick_server_files_are_checked_at_validation(
    world: World, data: dict[str, Any], code: str
) -> None:
    r = world.plan(world.manifest(f"file://{world.data_root}/train.jsonl", **data))
    assert r.status_code == 422 and r.json()["error"]["code"] == code, r.text
    assert "/etc/passwd" not in r.text


def test_metrics_have_their_own_listener_with_a_token(world: World) -> None:
    w = world
    assert w.client.get("/metrics").status_code == 404  # not on the API socket
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert w.client.get(path).status_code == 404  # not enabled by the operator
    host, port = w.client.app.state.metrics_address  # type: ignore[attr-defined]
    assert host == "127.0.0.1"
    url = f"http://{host}:{port}/metrics"
    assert httpx.get(url, timeout=5).status_code == 401
    assert (
        httpx.get(
            url, headers={"Authorization": "Bearer wrong-token-0123456789"}, timeout=5
        ).status_code
        == 401
    )
    good = httpx.get(url, headers={"Authorization": "Bearer scrape-token-0123456789"}, timeout=5)
    assert good.status_code == 200 and "ito_runs" in good.text
    assert httpx.get(f"http://{host}:{port}/other", timeout=5).status_code == 404


def _confirm(w: World, approver: str) -> str:
    m = w.manifest(f"file://{w.data_root}/train.jsonl")
    return confirm_ref(w.client, approver, "train", w.t.booking_id, manifest=m)


def _submit(w: World, ref: str, idem: str) -> httpx.Response:
    m = w.manifest(f"file://{w.data_root}/train.jsonl")
    return submit(w.client, w.t.submitter, w.t.booking_id, m, ref, idem)


def test_a_revoked_approvers_confirmation_is_refused(world: World) -> None:
    w = world
    ref = _confirm(w, w.t.approver)
    assert w.store.revoke_key(w.t.key_ids["approver"])
    r = _submit(w, ref, "key-revoked-1")
    assert r.status_code == 401 and r.json()["error"]["code"] == "credential_revoked", r.text
    assert w.store.read("SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0


def test_a_disabled_accounts_keys_and_confirmations_stop(world: World) -> None:
    w = world
    ref = _confirm(w, w.t.approver)
    assert w.store.disable_account("acme")
    r = _submit(w, ref, "key-disabled-1")
    assert r.status_code == 401 and r.json()["error"]["code"] == "account_disabled"
    r = w.client.get(f"/v1/bookings/{w.t.booking_id}/eligibility", headers=w.h())
    assert r.json()["error"]["code"] == "account_disabled"
    # Another account is untouched.
    r = w.client.get(
        f"/v1/bookings/{w.other.booking_id}/eligibility", headers=w.h(w.other.submitter)
    )
    assert r.status_code == 200


def test_a_flood_of_bad_keys_is_rate_limited_while_good_keys_are_served(world: World) -> None:
    w = world
    unauth = "SELECT COUNT(*) AS n, SUM(count) AS total FROM audit_events WHERE key_id IS NULL"
    rows_before = w.store.read(unauth)[0]["n"]
    codes = []
    for i in range(200):
        r = w.client.get(
            f"/v1/bookings/{w.t.booking_id}/eligibility",
            headers={"Authorization": f"Bearer itok_bad{i}_xxxxxxxx"},
        )
        codes.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limited"
            assert int(r.headers["Retry-After"]) >= 1
        if i % 20 == 0:  # a real tenant on the same address keeps working
            good = w.client.get(f"/v1/bookings/{w.t.booking_id}/eligibility", headers=w.h())
            assert good.status_code == 200
    assert codes[:FAIL_BURST] == [401] * FAIL_BURST
    assert codes.count(429) >= 190
    # The flood did not write a row per request: counted rows, flushed per window.
    w.client.app.state.ctx.store.flush_counted()  # type: ignore[attr-defined]
    rows = w.store.read(unauth)[0]
    # One row per (action, code): the bad key's 401s and the rate limiter's 429s.
    assert rows["n"] - rows_before == 2 and rows["total"] == 200


def test_a_key_over_its_rate_is_refused_with_retry_after(tmp_path: Path) -> None:
    db = tmp_path / "ito.db"
    t = make_tenant(db, "acme")
    settings = Settings(db_path=db, var_dir=tmp_path / "var", rate_key_burst=3, rate_key_per_s=0.01)
    with TestClient(create_app(settings)) as client:
        url = f"/v1/bookings/{t.booking_id}/eligibility"
        h = {"Authorization": f"Bearer {t.submitter}"}
        statuses = [client.get(url, headers=h) for _ in range(5)]
        assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
        assert statuses[3].json()["error"]["code"] == "rate_limited"
        assert int(statuses[3].headers["Retry-After"]) >= 1
        # Another key of the same tenant has its own bucket.
        h2 = {"Authorization": f"Bearer {t.approver}"}
        assert client.get(url, headers=h2).status_code == 200


def test_log_cursors_count_per_run(world: World) -> None:
    """A cursor reveals nothing about other tenants' log volume."""
    w = world
    ref = _confirm(w, w.t.approver)
    run_id = _submit(w, ref, "key-logs-0001").json()["data"]["run_id"]
    for i in range(50):  # someone else's busy run
        w.store.add_log("run_globex_busy", f"line {i}")
    w.store.add_log(run_id, "second line")
    page = w.client.get(f"/v1/runs/{run_id}/logs", headers=w.h()).json()["data"]
    assert [e["message"] for e in page["entries"]][-1] == "second line"
    assert page["next_cursor"] == str(len(page["entries"]))


def test_schema_migration_adds_roots_to_an_old_database(tmp_path: Path) -> None:
    import sqlite3

    from orchestrator.db.schema import MIGRATIONS

    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(
        MIGRATIONS[0] + ";CREATE TABLE schema_version (version INTEGER);"
        "INSERT INTO schema_version VALUES (1);"
    )
    conn.execute(
        "INSERT INTO logs (run_id, seq, ts, level, stage, message) "
        "VALUES ('r1', NULL, 0, 'info', 's', 'a')"
    )
    conn.commit()
    conn.close()
    store = Store(db)
    try:
        assert store.schema_version() == len(MIGRATIONS)
        assert store.list_logs("r1", 0, 10)[0]["run_seq"] == 1
        assert store.roots("nobody", "data") == ()
    finally:
        store.close()


def test_credentials_file_modes_and_symlinked_folder(tmp_path: Path) -> None:
    from orchestrator.client.credentials import read_credentials_file
    from stages.errors import ItoError

    real = tmp_path / "real"
    real.mkdir()
    f = real / "credentials"
    f.write_text("itok_abc_secret\n")
    for mode in (0o700, 0o200, 0o640):
        os.chmod(f, mode)
        with pytest.raises(ItoError) as e:
            read_credentials_file(str(f))
        assert e.value.code == "credentials_file_insecure", oct(mode)
    for mode in (0o600, 0o400):
        os.chmod(f, mode)
        key = read_credentials_file(str(f))
        assert key is not None and key.reveal() == "itok_abc_secret"
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ItoError) as e:
        read_credentials_file(str(tmp_path / "link" / "credentials"))
    assert e.value.code == "credentials_file_insecure"
