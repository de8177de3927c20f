"""One supervisor by lease, across real processes on a real PostgreSQL.

Each replica is the real ``RayRuntime`` loop (lease, fencing token, forget on
takeover) in its own process with a fake launcher in place of Ray and the drivers
(tests/helpers/lease_replica.py): what is under test is who may write, not what a
driver does. Processes are SIGKILLed and SIGSTOPped for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.postgres import PgServer
from helpers.store_rows import insert_run
from helpers.tenants import booking_doc
from helpers.waiting import wait_until

from orchestrator.db.store import Store
from orchestrator.gates.bookings import BookingFile, add_booking

pytestmark = pytest.mark.slow

LEASE_S = 3.0
POLL_S = 0.2
# How late after the lease ran out a standby's first write may land beyond its poll:
# a loaded 2-core host delays its poll thread and its first store calls by a fraction
# of this; a standby that waited out anything like one more lease (LEASE_S) is outside.
TAKEOVER_SLACK_S = LEASE_S / 2
WAIT_S = 60.0
TESTS = Path(__file__).resolve().parents[1]


class Replica:
    def __init__(self, db: str, tmp: Path, name: str, tick_s: float = 0.0):
        self.log = tmp / f"{name}.log"
        self.var = tmp / name
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "helpers.lease_replica",
                    "--db",
                    db,
                    "--var-dir",
                    str(tmp / name),
                    "--lease-s",
                    str(LEASE_S),
                    "--poll-s",
                    str(POLL_S),
                    "--tick-s",
                    str(tick_s),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"},
            )

    def ticks(self) -> int:
        """How many watch ticks it began (it is inside the newest one now)."""
        try:
            return int((self.var / "mid-tick").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def ready(self) -> bool:
        return (self.var / "ready").exists()

    def holds(self, store: Store) -> bool:
        row = store.lease("supervisor")
        return row is not None and f":{self.proc.pid}:" in row["holder"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _lease(store: Store) -> dict[str, Any]:
    row = store.lease("supervisor")
    assert row is not None
    return row


def _wait(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    wait_until(cond, timeout, what)


def _queue_run(store: Store, run_id: str) -> None:
    """A run of the world's account and booking (the supervisor stops a run whose
    booking or account lapsed, so both are real rows)."""
    account = store.account_by_name("acct")
    assert account is not None
    insert_run(store, run_id, account_id=account["account_id"], idempotency_key=run_id)


def _first_write_under(store: Store, run_ids: list[str], token: int) -> float:
    """When the holder of ``token`` first wrote to these runs (its events' times)."""
    return min(
        e["payload"]["ts"]
        for run_id in run_ids
        for e in store.list_events(run_id, kinds=["log"])
        if e["payload"]["message"].endswith(f" token={token}")
    )


def _messages(store: Store, run_id: str, word: str) -> list[str]:
    return [
        e["payload"]["message"]
        for e in store.list_events(run_id, kinds=["log"])
        if e["payload"]["message"].startswith(word)
    ]


@pytest.fixture
def world(pg_server: PgServer, tmp_path: Path) -> Iterator[tuple[Store, str, list[Replica]]]:
    db = pg_server.new_database()
    store = Store(db)
    store.create_account("acct")
    add_booking(store, BookingFile.model_validate(booking_doc("bk", "acct")))
    started: list[Replica] = []
    try:
        yield store, db, started
    finally:
        for r in started:
            r.stop()
        store.close()


def test_leader_killed_standby_takes_over_and_starts_the_queued_run(
    world: tuple[Store, str, list[Replica]], tmp_path: Path
) -> None:
    store, db, started = world
    a = Replica(db, tmp_path, "a")
    started.append(a)
    _wait(lambda: a.holds(store), "replica a to lead")
    b = Replica(db, tmp_path, "b")
    started.append(b)
    _queue_run(store, "run_1")
    _wait(lambda: store.get_run("run_1")["state"] == "running", "a to start run_1")
    assert a.holds(store)  # b stands by while a renews
    _wait(b.ready, "b to stand by")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(WAIT_S)
    # The dead leader's last renewal, by the database's clock: nothing moves it now.
    last = _lease(store)
    assert f":{a.proc.pid}:" in last["holder"] and last["token"] == 1
    _queue_run(store, "run_2")
    _wait(
        lambda: store.get_run("run_2")["state"] == "running",
        "the standby to take over and start run_2",
    )
    assert b.holds(store) and _lease(store)["token"] == 2
    # The new leader watches the run the old one started, and launched nothing twice.
    _wait(
        lambda: any("token=2" in m for m in _messages(store, "run_1", "watch")), "b to watch run_1"
    )
    assert _messages(store, "run_1", "launched") == ["launched token=1"]
    assert _messages(store, "run_2", "launched") == ["launched token=2"]
    # docs/ha.md's bound, from what the store recorded: the new leader's first fenced
    # write is after the old lease ran out (never two leaders) and within one of the
    # standby's polls of it, plus TAKEOVER_SLACK_S.
    first = _first_write_under(store, ["run_1", "run_2"], token=2)
    print(f"the standby's first write {first - last['expires_at']:.3f} s after the lease ran out")
    assert last["expires_at"] <= first <= last["expires_at"] + POLL_S + TAKEOVER_SLACK_S, (
        first - last["expires_at"]
    )


def test_paused_leader_that_lost_its_lease_changes_nothing(
    world: tuple[Store, str, list[Replica]], tmp_path: Path
) -> None:
    store, db, started = world
    # Slow ticks (a slow driver RPC): the pause lands between a watch's read and write.
    a = Replica(db, tmp_path, "a", tick_s=1.0)
    started.append(a)
    _wait(lambda: a.holds(store), "replica a to lead")
    _queue_run(store, "run_1")
    _wait(lambda: len(_messages(store, "run_1", "watch")) >= 2, "a to watch run_1")
    b = Replica(db, tmp_path, "b", tick_s=0.2)
    started.append(b)
    _wait(b.ready, "b to stand by")
    begun = a.ticks()
    _wait(lambda: a.ticks() > begun, "a to begin a watch tick")
    os.killpg(a.proc.pid, signal.SIGSTOP)
    _wait(lambda: b.holds(store), "b to take the lease over")
    _wait(
        lambda: sum("token=2" in m for m in _messages(store, "run_1", "watch")) >= 2,
        "b to watch run_1",
    )
    os.killpg(a.proc.pid, signal.SIGCONT)
    # Give the woken leader many of its ticks to try its stale write.
    seen = len(_messages(store, "run_1", "watch"))
    _wait(lambda: len(_messages(store, "run_1", "watch")) >= seen + 6, "b to keep watching")
    assert a.proc.poll() is None  # a is alive, standing by
    watches = _messages(store, "run_1", "watch")
    first_b = next(i for i, m in enumerate(watches) if "token=2" in m)
    assert all("token=2" in m for m in watches[first_b:]), watches
    assert b.holds(store) and _lease(store)["token"] == 2
    assert _messages(store, "run_1", "launched") == ["launched token=1"]
