"""A database blip is a 503, not a crash loop: with PostgreSQL stopped, store calls
answer 503 store_unavailable with Retry-After, liveness (/healthz) stays 200,
readiness (/readyz) is not ready, and service resumes without a restart once
PostgreSQL is back. A real PostgreSQL server of this test's own (it is stopped and
started again), a real ``ito-backend serve``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.backend import Backend
from helpers.postgres import PgServer, pg_bin, start_postgres
from helpers.tenants import make_tenant
from helpers.tools import missing

from orchestrator.db.engines import PASSWORD_FILE_ENV, StoreLimits
from orchestrator.db.store import Fence, Store
from stages.errors import ErrorCode, ItoError

# Answers are awaited this long at most: a hung server fails the test, not a clock.
ANSWER_WAIT_S = 60.0


@pytest.fixture
def own_pg() -> Iterator[PgServer]:
    """A PostgreSQL server this test may stop (the session's is shared)."""
    if pg_bin() is None:
        missing("postgres", "PostgreSQL is not installed (apt-get install postgresql)")
    before = os.environ.get(PASSWORD_FILE_ENV)
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()
        if before is None:
            os.environ.pop(PASSWORD_FILE_ENV, None)
        else:
            os.environ[PASSWORD_FILE_ENV] = before


def _until_served(client: httpx.Client, url: str, headers: dict[str, str]) -> httpx.Response:
    deadline = time.monotonic() + ANSWER_WAIT_S
    while True:
        r = client.get(url, headers=headers)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


@pytest.mark.slow
def test_postgres_stopped_is_503_with_liveness_up_and_service_back_without_restart(
    own_pg: PgServer, tmp_path: Path
) -> None:
    db = own_pg.new_database()
    t = make_tenant(db, "acme")
    b = Backend(db=db, var_dir=tmp_path / "var", log_path=tmp_path / "backend.log").start()
    assert b.proc is not None
    pid = b.proc.pid
    runs = "/v1/runs?idempotency_key=no-such-key-1"
    auth = {"Authorization": f"Bearer {t.submitter}"}
    try:
        with httpx.Client(base_url=b.url, timeout=ANSWER_WAIT_S) as client:
            assert client.get(runs, headers=auth).json()["data"] == {
                "runs": []
            }  # the store answers
            assert client.get("/readyz").status_code == 200
            own_pg.halt()
            t0 = time.perf_counter()
            down = client.get(runs, headers=auth)
            first_503_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = client.get(runs, headers=auth)
            next_503_s = time.perf_counter() - t0
            live = client.get("/healthz")
            ready = client.get("/readyz")
            own_pg.resume()
            t0 = time.perf_counter()
            back = _until_served(client, runs, auth)
            back_s = time.perf_counter() - t0
            ready_again = client.get("/readyz")
        for r in (down, again, ready):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable"
            assert int(r.headers["Retry-After"]) >= 1
        assert live.status_code == 200 and live.json()["data"]["status"] == "ok"
        assert back.status_code == 200 and back.json()["data"] == {"runs": []}
        assert ready_again.status_code == 200
        assert b.proc.poll() is None and b.proc.pid == pid  # the same process throughout
        assert "Traceback" not in b.log_text()
        print(
            f"\nPostgreSQL stopped: first 503 in {first_503_s:.3f} s, the next in "
            f"{next_503_s:.3f} s; /healthz {live.status_code}, /readyz {ready.status_code}; "
            f"served again {back_s:.3f} s after PostgreSQL's restart (same pid)"
        )
    finally:
        b.stop()


@pytest.mark.slow
def test_every_store_call_and_the_lease_are_store_unavailable_while_postgres_is_down(
    own_pg: PgServer,
) -> None:
    """The supervisor's lease and fenced writes see an ItoError (its loop carries on),
    never a driver exception or a hang; the same Store works again after the restart."""
    store = Store(own_pg.new_database(), StoreLimits(fail_fast_s=0.5))
    fence = Fence("supervisor", "replica-a")
    assert store.acquire_lease(fence, lease_s=30) == 1
    own_pg.halt()
    try:
        for call in (
            lambda: store.acquire_lease(fence, lease_s=30),
            lambda: store.fenced(fence).transition("run_1", "running", "x"),
            lambda: store.runs_in_states(["running"]),
            store.schema_version,
        ):
            with pytest.raises(ItoError) as e:
                call()
            assert e.value.code == ErrorCode.store_unavailable
            assert int(str(e.value.details["retry_after_s"])) >= 1
        # A counted refusal is not lost: its row waits for the store.
        store.audit_counted("request", "validation_error", window_s=0, gate="input")
    finally:
        own_pg.resume()
    deadline = time.monotonic() + ANSWER_WAIT_S
    while True:
        try:
            assert store.acquire_lease(fence, lease_s=30) == 1
            break
        except ItoError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    store.flush_counted()
    rows = store.read("SELECT SUM(count) AS n FROM audit_events WHERE gate = 'input'")
    assert rows[0]["n"] == 1  # the refusal counted while the store was down is kept
    store.close()
