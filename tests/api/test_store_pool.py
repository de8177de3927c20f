"""The PostgreSQL pool's check as a store call takes a connection: a live idle
connection is handed over without a round trip (pinging each one cost a round trip per
store call), a connection whose session the server ended is replaced, never handed to
a call (the call succeeds on a fresh one). A real PostgreSQL server; the server's own
``pg_stat_activity`` shows the last statement each session ran."""

from __future__ import annotations

import time

import psycopg
from helpers.postgres import PgServer

from orchestrator.db.engines import PostgresEngine, StoreLimits

# The terminated backend is awaited this long at most: a hang fails the test, not a clock.
GONE_WAIT_S = 30.0


def _engine(pg_server: PgServer) -> tuple[PostgresEngine, psycopg.Connection]:
    url = pg_server.new_database()
    # One pooled connection: every call takes the same one.
    engine = PostgresEngine(url, StoreLimits(pool_min_size=1, pool_max_size=1))
    observer = psycopg.connect(
        url, password=pg_server.password_file.read_text().strip(), autocommit=True
    )
    return engine, observer


def _last_statement(observer: psycopg.Connection, pid: int) -> str | None:
    row = observer.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return None if row is None else str(row[0])


def test_a_live_pooled_connection_is_taken_without_a_round_trip(pg_server: PgServer) -> None:
    engine, observer = _engine(pg_server)
    try:
        [row] = engine.read("SELECT pg_backend_pid() AS pid, 'marker-1' AS m")
        pid = row["pid"]
        mark = _last_statement(observer, pid)
        assert mark is not None and "marker-1" in mark
        with engine.pool.connection() as conn:  # the check runs as the call takes it
            assert conn.info.backend_pid == pid
        # The session ran nothing since: no ping (the old check left "" here).
        assert _last_statement(observer, pid) == mark
    finally:
        engine.close()
        observer.close()


def test_a_connection_whose_session_the_server_ended_is_replaced(pg_server: PgServer) -> None:
    engine, observer = _engine(pg_server)
    try:
        [row] = engine.read("SELECT pg_backend_pid() AS pid")
        pid = row["pid"]
        observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + GONE_WAIT_S
        while _last_statement(observer, pid) is not None:
            assert time.monotonic() < deadline, "the backend did not end"
            time.sleep(0.05)
        # Without a check this call got the dead connection: 503 store_unavailable.
        [again] = engine.read("SELECT pg_backend_pid() AS pid")
        assert again["pid"] != pid
    finally:
        engine.close()
        observer.close()
