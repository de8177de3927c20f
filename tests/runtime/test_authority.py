"""Authority re-checks of active runs, and the operator's ``runs stop``, on a real
SQLite store. The supervisor applying them to live runs on Ray is in
tests/runtime/test_run_controls_on_ray.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.store_rows import insert_run
from helpers.tenants import admin, make_tenant

from orchestrator.db.store import Store
from orchestrator.runtime.authority import lapsed, stop_code
from stages.errors import ErrorCode


def _run(store: Store, account_id: str, booking_id: str, run_id: str = "run_a") -> dict:
    insert_run(store, run_id, account_id=account_id, booking_id=booking_id)
    return store.get_run(run_id)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    db = tmp_path / "ito.db"
    make_tenant(db, "acme")
    make_tenant(db, "globex")
    return Store(db)


def _ids(store: Store, name: str) -> tuple[str, str]:
    account = store.account_by_name(name)
    assert account is not None
    return account["account_id"], f"bk-{name}"


def test_a_run_keeps_its_authority_while_booking_account_and_term_hold(store: Store) -> None:
    run = _run(store, *_ids(store, "acme"))
    assert lapsed(store, run) is None


@pytest.mark.parametrize(
    ("change", "code"),
    [("revoked", ErrorCode.booking_revoked), ("released", ErrorCode.booking_released)],
)
def test_a_revoked_or_released_booking_lapses_the_run(
    store: Store, change: str, code: ErrorCode
) -> None:
    account_id, booking_id = _ids(store, "acme")
    run = _run(store, account_id, booking_id)
    store.set_booking_state(booking_id, change)
    lapse = lapsed(store, run)
    assert lapse is not None and lapse.code == code
    assert stop_code(lapse.state_reason()) == code


def test_a_disabled_account_lapses_its_runs_and_no_other_accounts(store: Store) -> None:
    acme = _run(store, *_ids(store, "acme"), run_id="run_acme")
    globex = _run(store, *_ids(store, "globex"), run_id="run_globex")
    assert store.disable_account("acme")
    lapse = lapsed(store, acme)
    assert lapse is not None and lapse.code == ErrorCode.account_disabled
    assert lapsed(store, globex) is None


def test_the_end_of_the_booking_term_lapses_the_run(store: Store) -> None:
    account_id, booking_id = _ids(store, "acme")
    run = _run(store, account_id, booking_id)
    term_end = store.booking(booking_id)["term_end"]  # type: ignore[index]
    assert lapsed(store, run, now=term_end - 1) is None
    lapse = lapsed(store, run, now=term_end)
    assert lapse is not None and lapse.code == ErrorCode.booking_term_ended


def test_a_booking_moved_to_another_account_lapses_the_run(store: Store) -> None:
    account_id, booking_id = _ids(store, "acme")
    run = _run(store, account_id, booking_id)
    with store.tx() as c:  # the upstream registry reassigned it (mocked here)
        c.execute(
            "UPDATE bookings SET account_id = ? WHERE booking_id = ?",
            (_ids(store, "globex")[0], booking_id),
        )
    lapse = lapsed(store, run)
    assert lapse is not None and lapse.code == ErrorCode.booking_revoked


def test_stop_code_reads_only_stable_codes() -> None:
    assert stop_code("operator_stopped: abuse report") == "operator_stopped"
    assert stop_code("cancel requested") is None
    assert stop_code("waiting: for nodes") is None


@pytest.mark.slow
def test_operator_runs_stop_is_audited_and_refuses_what_cannot_stop(tmp_path: Path) -> None:
    db = tmp_path / "ito.db"
    make_tenant(db, "acme")
    store = Store(db)
    account_id, booking_id = _ids(store, "acme")
    _run(store, account_id, booking_id)

    for bad in ("", "two\nlines\x1b[2J", "x" * 501, "token itok_" + "a" * 40):
        env = admin(db, "runs", "stop", "run_a", "--reason", bad, check=False)
        assert env["error"]["code"] == "bad_request", bad
    assert store.get_run("run_a")["state"] == "accepted"

    env = admin(db, "runs", "stop", "run_a", "--reason", "abuse report #12")
    assert env["data"]["state"] == "cancelling"
    run = store.get_run("run_a")
    assert run["state"] == "cancelling"
    assert run["state_reason"] == "operator_stopped: abuse report #12"
    rows = store.read("SELECT * FROM audit_events WHERE action = 'admin:runs.stop'")
    assert [(r["run_id"], r["account_id"], r["booking_id"], r["code"]) for r in rows] == [
        ("run_a", account_id, booking_id, "operator_stopped")
    ]

    # Already stopping (or ended): the transition table refuses it; nothing is audited.
    again = admin(db, "runs", "stop", "run_a", "--reason", "again", check=False)
    assert again["error"]["code"] == "invalid_state"
    assert (
        admin(db, "runs", "stop", "run_nope", "--reason", "x", check=False)["error"]["code"]
        == "run_not_found"
    )
    assert len(store.read("SELECT 1 FROM audit_events WHERE action = 'admin:runs.stop'")) == 1
    store.close()
