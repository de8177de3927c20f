"""``Store.read_batch`` on PostgreSQL: its reads are prepared once per pooled connection
and run as ``EXECUTE``s in one read-only ``REPEATABLE READ`` transaction, so a batch
sees one snapshot (a write committed while it runs shows in none of its reads or in
all), a migration that changes a prepared ``SELECT *``'s columns is answered with the
new columns, and a failed batch leaves its connection idle. A real PostgreSQL server."""

from __future__ import annotations

import threading

import psycopg
import pytest
from helpers.postgres import PgServer
from helpers.store_rows import insert_run

from orchestrator.db.engines import StoreLimits
from orchestrator.db.pg_batch import prepared_read
from orchestrator.db.store import Store
from stages.errors import ErrorCode, ItoError

# The writer's commit falls inside the batch's sleep; the sleep bounds the test only.
BATCH_SLEEP_S = 1.0
WRITER_DELAY_S = 0.3
COUNT = "SELECT COUNT(*) AS n FROM runs"


def _store(pg_server: PgServer) -> tuple[Store, str]:
    url = pg_server.new_database()
    # One pooled connection: every batch runs on the same session.
    return Store(url, StoreLimits(pool_min_size=1, pool_max_size=1)), url


def test_a_batch_sees_one_snapshot_while_a_write_commits_between_its_reads(
    pg_server: PgServer,
) -> None:
    store, url = _store(pg_server)
    insert_run(store, "run_1")
    writer_store = Store(url)

    def write() -> None:
        threading.Event().wait(WRITER_DELAY_S)
        insert_run(writer_store, "run_2")

    writer = threading.Thread(target=write)
    writer.start()
    try:
        before, _, after = store.read_batch(
            [(COUNT, ()), ("SELECT pg_sleep(?) AS slept", (BATCH_SLEEP_S,)), (COUNT, ())]
        )
    finally:
        writer.join()
    # The write committed while the batch slept: its own reads agree with each other.
    assert before == after == [{"n": 1}]
    assert store.read_batch([(COUNT, ())]) == [[{"n": 2}]]
    writer_store.close()
    store.close()


def test_a_batch_runs_its_reads_as_statements_prepared_on_its_connection(
    pg_server: PgServer,
) -> None:
    store, _ = _store(pg_server)
    insert_run(store, "run_1")
    reads = [("SELECT run_id FROM runs WHERE run_id = ?", ("run_1",)), (COUNT, ())]
    listed = ("SELECT name FROM pg_prepared_statements ORDER BY name", ())
    for _ in range(3):
        *answers, prepared = store.read_batch([*reads, listed])
        assert answers == [[{"run_id": "run_1"}], [{"n": 1}]]
    names = {r["name"] for r in prepared}
    assert {prepared_read(sql)[0] for sql, _ in [*reads, listed]} <= names
    store.close()


def test_a_migration_under_a_prepared_select_star_is_answered_with_its_new_columns(
    pg_server: PgServer,
) -> None:
    store, url = _store(pg_server)
    insert_run(store, "run_1")
    read = ("SELECT * FROM runs WHERE run_id = ?", ("run_1",))
    [[before]] = store.read_batch([read])
    assert "added_later" not in before
    # Another replica's migration, in a rolling upgrade: a column more on the table.
    with psycopg.connect(
        url, password=pg_server.password_file.read_text().strip(), autocommit=True
    ) as other:
        other.execute("ALTER TABLE runs ADD COLUMN added_later TEXT DEFAULT 'x'")
    [[after]] = store.read_batch([read])
    assert after == {**before, "added_later": "x"}
    store.close()


def test_a_failed_batch_leaves_its_connection_idle_and_the_next_batch_answers(
    pg_server: PgServer,
) -> None:
    store, _ = _store(pg_server)
    insert_run(store, "run_1")
    with pytest.raises(ItoError) as failed:  # division by zero: a value the store refuses
        store.read_batch([(COUNT, ()), ("SELECT 1 / ? AS x", (0,)), (COUNT, ())])
    assert failed.value.code == ErrorCode.validation_error
    with store.engine.pool.connection() as conn:  # the pool's one connection
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert store.read_batch([(COUNT, ()), ("SELECT 1 / ? AS x", (1,))]) == [
        [{"n": 1}],
        [{"x": 1}],
    ]
    store.close()


def test_a_batch_after_psycopg_deallocated_the_session_s_statements_answers(
    pg_server: PgServer,
) -> None:
    store, _ = _store(pg_server)
    insert_run(store, "run_1")
    read = ("SELECT run_id FROM runs WHERE run_id = ?", ("run_1",))
    assert store.read_batch([read]) == [[{"run_id": "run_1"}]]
    # Enough single reads on the one connection that psycopg prepares its own statement,
    # then a rolled-back write: psycopg answers the rollback with DEALLOCATE ALL.
    for _ in range(10):
        store.read("SELECT state FROM runs WHERE run_id = ?", ("run_1",))
    with pytest.raises(RuntimeError), store.tx() as c:
        c.execute("UPDATE runs SET state_reason = ? WHERE run_id = ?", ("x", "run_1"))
        raise RuntimeError("refused inside the transaction")
    listed = ("SELECT COUNT(*) AS n FROM pg_prepared_statements WHERE name LIKE 'ito%'", ())
    assert store.read_batch([read, listed]) == [[{"run_id": "run_1"}], [{"n": 2}]]
    store.close()
