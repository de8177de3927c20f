"""The store: schema versioning, WAL, transitions, event ingestion (idempotent), the
supervisor lease and its fence; the engine-independent ones on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers.fixtures import both_engines
from helpers.store_rows import insert_run
from helpers.waiting import wait_until

from orchestrator.db.schema import SCHEMA_VERSION
from orchestrator.db.store import Fence, Store
from orchestrator.runs import TRANSITIONS, RunState, can_transition, check_transition
from stages.errors import ErrorCode, ItoError
from stages.events import CheckpointEvent, LogEvent, ProposalEvent, StageResultEvent


def _lease(store: Store) -> dict[str, Any]:
    row = store.lease("supervisor")
    assert row is not None
    return row


def _run(store: Store, run_id: str = "run_1", key: str = "k1") -> None:
    insert_run(store, run_id, idempotency_key=key)


def test_schema_versioned_and_wal(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    assert store.schema_version() == SCHEMA_VERSION
    assert store.read("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
    store.close()
    # Reopening applies nothing twice.
    again = Store(tmp_path / "s.db")
    assert again.schema_version() == SCHEMA_VERSION
    with again.tx() as c:
        c.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    again.close()
    with pytest.raises(RuntimeError, match="newer"):
        Store(tmp_path / "s.db")


@both_engines
def test_transition_table_is_enforced(db: str) -> None:
    store = Store(db)
    _run(store)
    with pytest.raises(ItoError) as e:
        store.transition("run_1", RunState.succeeded)
    assert e.value.code == ErrorCode.invalid_state
    for state in (RunState.starting, RunState.running, RunState.succeeded, RunState.cleaned):
        store.transition("run_1", state, f"to {state}")
    assert store.get_run("run_1")["state"] == "cleaned"
    assert [r["run_id"] for r in store.runs_in_states([RunState.cleaned])] == ["run_1"]
    # Every state is in the table; cleaned is final; nothing goes back to accepted.
    assert set(TRANSITIONS) == set(RunState)
    assert not TRANSITIONS[RunState.cleaned]
    assert not any(can_transition(s, RunState.accepted) for s in RunState)
    with pytest.raises(ItoError):
        check_transition("running", "bogus")


@both_engines
def test_ingest_is_idempotent_and_derives_tables(db: str) -> None:
    store = Store(db)
    _run(store)
    events = [
        {**LogEvent(message="hi", stage="trainer").model_dump(), "seq": 0},
        {
            **CheckpointEvent(
                step=10, path="/c/10", bytes=100, blocking_s=0.1, total_s=1.0
            ).model_dump(),
            "seq": 1,
        },
        {
            **StageResultEvent(
                outcome={
                    "stage": "trainer",
                    "status": "failed",
                    "reason": "gate",
                    "error_code": "gate_failed",
                }
            ).model_dump(),
            "seq": 2,
        },
        {
            **ProposalEvent(
                proposal_id="p1", action="restart_from_checkpoint", description="spike"
            ).model_dump(),
            "seq": 3,
        },
    ]
    assert store.ingest_events("run_1", events) == 4
    assert store.ingest_events("run_1", events) == 0  # a re-sent batch adds nothing
    assert [e["seq"] for e in store.list_events("run_1")] == [0, 1, 2, 3]
    assert [e["kind"] for e in store.list_events("run_1", after_seq=1, kinds=["proposal"])] == [
        "proposal"
    ]
    assert store.max_seq("run_1") == 3
    assert store.list_checkpoints("run_1")[0]["step"] == 10
    assert store.list_stage_gates("run_1")[0]["error_code"] == "gate_failed"
    assert store.list_proposals("run_1")[0]["status"] == "pending"
    assert [r["message"] for r in store.list_logs("run_1", 0, 10)] == ["hi"]
    with pytest.raises(ItoError) as e:
        store.ingest_events("run_1", [{"seq": 9, "kind": "nope"}])
    assert e.value.code == ErrorCode.bad_request
    with pytest.raises(ItoError) as e:
        store.ingest_events("run_missing", events)
    assert e.value.code == ErrorCode.run_not_found
    store.set_run_field("run_1", plan={"dp": 2}, data_prep={"kept": 10})
    assert store.get_run("run_1")["plan"] == '{"dp": 2}'


@both_engines
def test_key_unique_per_account(db: str) -> None:
    store = Store(db)
    _run(store, "run_1", "same-key")
    with pytest.raises((sqlite3.IntegrityError, psycopg.IntegrityError)):
        _run(store, "run_2", "same-key")


@both_engines
def test_concurrent_writers_serialise(db: str) -> None:
    """Eight threads, own connections: no lost update, no lock error."""
    store = Store(db)
    _run(store)
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(20):
                store.ingest_events(
                    "run_1", [{**LogEvent(message="m").model_dump(), "seq": base * 100 + i}]
                )
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.list_events("run_1")) == 160


@both_engines
def test_parallel_first_open_migrates_once(db: str) -> None:
    """Several openers of a fresh store at once (replicas + admin CLI): one migrates."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def open_store() -> None:
        try:
            barrier.wait()
            Store(db).close()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.read("SELECT COUNT(*) AS n FROM schema_version")[0]["n"] == 1


@both_engines
def test_last_event_is_the_newest_of_its_kind(db: str) -> None:
    from stages.events import ProgressEvent

    store = Store(db)
    _run(store)
    assert store.last_event("run_1", "progress") is None
    events = [
        {**ProgressEvent(stage="data_prep", step=s, docs_done=d).model_dump(mode="json"), "seq": i}
        for i, (s, d) in enumerate((("sketch", 10), ("verify", 20)))
    ]
    events.append({**LogEvent(message="later").model_dump(mode="json"), "seq": 2})
    assert store.ingest_events("run_1", events) == 3
    last = store.last_event("run_1", "progress")
    assert last is not None and last["step"] == "verify" and last["docs_done"] == 20


@both_engines
def test_lease_has_one_holder_and_fences_a_stale_one(db: str) -> None:
    """One holder at a time; a takeover after expiry bumps the token; the old holder's
    fenced write is refused and changes nothing; renewing is not retaking."""
    store = Store(db)
    _run(store)
    a, b = Fence("supervisor", "replica-a"), Fence("supervisor", "replica-b")
    assert store.acquire_lease(a, lease_s=60) == 1
    assert store.acquire_lease(b, lease_s=60) is None  # a's lease is live
    assert store.acquire_lease(a, lease_s=0.2) == 1  # renewal keeps the token
    stale = store.fenced(Fence("supervisor", "replica-a", token=1))
    stale.transition("run_1", RunState.starting, "by the leader")
    deadline = time.monotonic() + 30
    while store.acquire_lease(b, lease_s=60) is None:  # a stopped renewing
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    assert b.token == 2 and _lease(store)["holder"] == "replica-b"
    with pytest.raises(ItoError) as e:
        stale.transition("run_1", RunState.running, "by a stale leader")
    assert e.value.code == ErrorCode.lease_lost
    with pytest.raises(ItoError):
        stale.ingest_events("run_1", [{**LogEvent(message="stale").model_dump(), "seq": 0}])
    assert store.get_run("run_1")["state"] == "starting" and store.max_seq("run_1") == -1
    assert store.acquire_lease(a, lease_s=60) is None and a.token is None
    store.fenced(b).transition("run_1", RunState.running, "by the new leader")
    store.release_lease(b)  # a clean shutdown hands over at once
    assert store.acquire_lease(a, lease_s=60) == 3


@both_engines
def test_a_leader_past_its_lease_is_fenced_before_any_takeover(db: str) -> None:
    """A leader paused past its lease (a long GC, SIGSTOP) whose lease no standby has
    taken yet still holds the row's holder and token: expiry alone must refuse its
    fenced writes, or it writes while a standby may already be entitled to lead."""
    store = Store(db)
    _run(store)
    a = Fence("supervisor", "replica-a")
    assert store.acquire_lease(a, lease_s=0.1) == 1
    paused = store.fenced(Fence("supervisor", "replica-a", token=1))
    paused.transition("run_1", RunState.starting, "while the lease is live")
    wait_until(
        lambda: store.read(
            f"SELECT expires_at <= {store.engine.now_sql} AS out FROM leases WHERE name = ?",
            ("supervisor",),
        )[0]["out"],
        30,
        "the lease to expire by the database's clock",
    )
    assert _lease(store)["holder"] == "replica-a" and _lease(store)["token"] == 1  # no takeover
    with pytest.raises(ItoError) as e:
        paused.transition("run_1", RunState.running, "after the lease ran out")
    assert e.value.code == ErrorCode.lease_lost
    with pytest.raises(ItoError) as e:
        paused.ingest_events("run_1", [{**LogEvent(message="late").model_dump(), "seq": 0}])
    assert e.value.code == ErrorCode.lease_lost
    assert store.get_run("run_1")["state"] == "starting" and store.max_seq("run_1") == -1
    # Waking, it takes the lease anew like any standby would: a new token.
    assert store.acquire_lease(a, lease_s=60) == 2
    store.fenced(a).transition("run_1", RunState.running, "under the new token")
    store.close()


def test_a_password_in_the_store_url_is_refused() -> None:
    """A URL is argv: the password comes from ITO_DB_PASSWORD_FILE or libpq's env."""
    with pytest.raises(ItoError) as e:
        Store("postgresql://ito:hunter2hunter2@127.0.0.1:1/ito")
    assert e.value.code == ErrorCode.bad_request and "hunter2" not in e.value.message
