"""The store's two engines: embedded SQLite and PostgreSQL for several API replicas.

The store's SQL is written once, in the dialect both engines share (``?`` and
``:name`` parameters, ``INSERT ... ON CONFLICT``, ``SELECT ... FOR UPDATE``).
Each engine opens one write transaction at a time per connection:

* SQLite (one file, WAL): ``BEGIN IMMEDIATE`` takes the database's one write lock
  at the start, so writers are serial and ``FOR UPDATE`` / ``FOR SHARE`` are
  dropped (the lock already covers every row).
* PostgreSQL (psycopg 3, a connection pool): ``READ COMMITTED`` transactions;
  what must be exclusive locks its row with ``SELECT ... FOR UPDATE`` and what
  must be unique has a unique constraint. A transaction that loses a unique or
  serialisation race is rolled back and ``Store.write`` runs it again, once it
  can see the winner's committed row.

A store that cannot be reached (PostgreSQL down or partitioned, the pool exhausted,
SQLite's file locked past its busy timeout or unreadable) raises
``ItoError(store_unavailable)`` within the limits of ``StoreLimits``, never a
driver's exception after a long wait; after such a failure calls fail fast for
``fail_fast_s`` (``Outage``), then try the store again, so service resumes by itself.

The password never travels in argv: a ``postgresql://`` URL with a password is
refused; libpq's own ``PGPASSWORD`` / ``PGPASSFILE`` work, and
``ITO_DB_PASSWORD_FILE`` names a file holding only the password (a mounted secret).

``read_batch`` runs several reads as one, from one snapshot: on PostgreSQL one round
trip (``pg_batch``: the reads' prepared statements executed in one read-only
transaction, psycopg binding the parameters client-side), on SQLite one read
transaction. A status read is one such batch: each round trip costs the client more
CPU (its system calls on the socket above all) than the rows it carries.
"""

from __future__ import annotations

import math
import os
import re
import select
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.db.pg_batch import PreparedReads, read_prepared
from stages.errors import ErrorCode, ItoError

Row = dict[str, Any]
# One read of a batch: SQL with ``?`` parameters (not ``:name``), and its parameters.
Read = tuple[str, Sequence[Any]]
WAL_RETRY_S = 0.01
PASSWORD_FILE_ENV = "ITO_DB_PASSWORD_FILE"
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
# Serialises the first migration of a fresh PostgreSQL database across replicas.
MIGRATION_LOCK_ID = 0x17_0_0_5
# A server that starts waits this long at least for its store's first connection.
START_WAIT_S = 30.0
_LOCK_CLAUSE = re.compile(r"\s+FOR\s+(UPDATE|SHARE)\b")


def is_postgres(db: str | Path) -> bool:
    return isinstance(db, str) and db.startswith(POSTGRES_SCHEMES)


class StoreLimits(BaseModel):
    """How long a store call may wait before it answers ``store_unavailable``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # SQLite waits this long for a write lock before ``database is locked``: a writer
    # holding it longer is stuck, and each waiting request holds a handler thread.
    sqlite_busy_timeout_ms: int = Field(default=5_000, gt=0)
    # PostgreSQL: a new connection's connect (libpq counts whole seconds, at least 2),
    # and a call's wait for a pooled connection. Short, so a database blip is a quick
    # 503 the client retries, not a thread held for half a minute and then a 500 (the
    # pool has more connections than the server has request threads: a healthy store
    # never makes a call wait this long).
    connect_timeout_s: float = Field(default=2.0, gt=0, le=60)
    pool_wait_s: float = Field(default=1.5, gt=0, le=60)
    # One statement at most this long (server side): a stuck lock or a runaway query
    # ends as store_unavailable. Migrations lift it for their own transaction.
    statement_timeout_ms: int = Field(default=5_000, gt=0)
    # A process paused (SIGSTOP) or partitioned inside a transaction keeps its row
    # locks (a lease row among them) until the server ends its session: this bounds
    # it, well inside the supervisor lease.
    idle_in_transaction_timeout_ms: int = Field(default=5_000, gt=0)
    # Sent data unacknowledged this long drops the connection (libpq
    # tcp_user_timeout): a partitioned server cannot hold a call the statement timeout
    # (which the server itself enforces) never ends.
    tcp_user_timeout_ms: int = Field(default=10_000, gt=0)
    # The pool's connections; a failed reconnection is retried with backoff for at
    # most this long before a new attempt starts from the first delay, so the pool
    # reconnects within seconds of the server's return, not minutes.
    pool_min_size: int = Field(default=1, ge=0)
    pool_max_size: int = Field(default=16, ge=1)
    reconnect_backoff_s: float = Field(default=4.0, gt=0, le=300)
    # After a call found the store unreachable, calls fail at once for this long (no
    # connect, no wait): a blip costs a request microseconds, and the store is tried
    # again this soon after.
    fail_fast_s: float = Field(default=1.0, ge=0, le=60)
    # The Retry-After a client is given with store_unavailable (whole seconds).
    retry_after_s: int = Field(default=2, ge=1, le=300)


def unavailable(limits: StoreLimits, why: str) -> ItoError:
    return ItoError(
        ErrorCode.store_unavailable,
        f"the store is unavailable ({why}); retry later",
        details={"retry_after_s": limits.retry_after_s},
    )


class Outage:
    """Fail fast while the store is known unreachable, try it again after a while."""

    def __init__(self, limits: StoreLimits):
        self.limits = limits
        self._until = 0.0
        self.why = ""

    def check(self) -> None:
        if self._until and time.monotonic() < self._until:
            raise unavailable(self.limits, self.why)

    def tripped(self, why: str) -> None:
        self.why = why
        self._until = time.monotonic() + self.limits.fail_fast_s

    def cleared(self) -> None:
        self._until = 0.0


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Conn(Protocol):
    """What the store's SQL runs on inside one transaction (either engine)."""

    def execute(self, sql: str, params: Any = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Any]) -> Any: ...


class Engine(Protocol):
    dialect: str
    # The database's clock, in epoch seconds (leases compare against it, not a host's).
    now_sql: str

    def tx(self) -> Iterator[Conn]: ...

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]: ...

    def read_batch(self, reads: Sequence[Read]) -> list[list[Row]]: ...

    def retryable(self, e: BaseException) -> bool: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...


# --- SQLite ---------------------------------------------------------------------------
# SQLite's result codes of a file that cannot be used at all (not of a bad statement).
_SQLITE_OUTAGES = ("SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_FULL", "SQLITE_READONLY")


def _sqlite_row(cur: sqlite3.Cursor, raw: tuple[Any, ...]) -> Row:
    return {d[0]: v for d, v in zip(cur.description, raw, strict=True)}


@lru_cache(maxsize=512)
def _sqlite_sql(sql: str) -> str:
    return _LOCK_CLAUSE.sub("", sql)


class _SqliteConn:
    def __init__(self, conn: sqlite3.Connection):
        self.raw = conn

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        return self.raw.execute(_sqlite_sql(sql), params)

    def executemany(self, sql: str, rows: Sequence[Any]) -> sqlite3.Cursor:
        return self.raw.executemany(_sqlite_sql(sql), rows)


class SqliteEngine:
    """SQLite in WAL mode, one connection per thread."""

    dialect = "sqlite"
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: str | Path, limits: StoreLimits):
        self.path = str(path)
        self.limits = limits
        self.busy_timeout_ms = limits.sqlite_busy_timeout_ms
        self.outage = Outage(limits)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.path

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: no implicit transactions; we BEGIN explicitly.
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=self.busy_timeout_ms / 1000,
            )
            conn.row_factory = _sqlite_row
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            self._ensure_wal(conn)
            # FULL: an acknowledged commit survives a power cut, not only a SIGKILL.
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _ensure_wal(self, conn: sqlite3.Connection) -> None:
        """WAL is persistent in the file; only the first openers switch it. Switching
        needs an exclusive lock and SQLite answers ``database is locked`` without
        waiting when another opener holds one, so retry until the busy timeout."""
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode").fetchone()["journal_mode"]
                if (
                    mode == "wal"
                    or conn.execute("PRAGMA journal_mode = WAL").fetchone()["journal_mode"] == "wal"
                ):
                    return
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot put {self.path} in WAL mode")
            time.sleep(WAL_RETRY_S)

    @contextmanager
    def tx(self) -> Iterator[Conn]:
        """One write transaction; the write lock is taken at BEGIN, not at first write."""
        with self.guarded():
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteConn(conn)
                conn.execute("COMMIT")
            except BaseException:
                # Also after a failed COMMIT: never leave the thread's connection
                # mid-transaction.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        with self.guarded():
            rows: list[Row] = self._conn().execute(_sqlite_sql(sql), tuple(params)).fetchall()
        return rows

    def read_batch(self, reads: Sequence[Read]) -> list[list[Row]]:
        """Every read from one snapshot (one read transaction)."""
        with self.guarded():
            conn = self._conn()
            own = not conn.in_transaction  # inside the thread's open transaction: its view
            if own:
                conn.execute("BEGIN")
            try:
                return [conn.execute(_sqlite_sql(sql), tuple(p)).fetchall() for sql, p in reads]
            finally:
                if own and conn.in_transaction:
                    conn.execute("COMMIT")

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """A locked or unreadable file is store_unavailable; an unreadable one (the disk
        gone, the file removed) also makes calls fail fast for a while."""
        self.outage.check()
        try:
            yield
        except sqlite3.OperationalError as e:
            name = str(getattr(e, "sqlite_errorname", ""))
            if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
                raise unavailable(self.limits, "the database is locked") from e
            if name.startswith(_SQLITE_OUTAGES):
                self.outage.tripped("the database file cannot be read or written")
                raise unavailable(self.limits, self.outage.why) from e
            raise

    def retryable(self, e: BaseException) -> bool:
        return False  # writers are serial: no transaction loses a race

    def close(self) -> None:
        with self._lock:
            for c in self._all:
                c.close()
            self._all.clear()
        self._local = threading.local()


# --- PostgreSQL -----------------------------------------------------------------------
_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """``?`` and ``:name`` parameters as psycopg's ``%s`` and ``%(name)s``."""
    sql = sql.replace("%", "%%")
    sql = _NAMED.sub(r"%(\1)s", sql)
    return sql.replace("?", "%s")


class _PgConn:
    def __init__(self, conn: Any):
        self.raw = conn

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.raw.execute(_pg_sql(sql), params)

    def executemany(self, sql: str, rows: Sequence[Any]) -> Any:
        with self.raw.cursor() as cur:
            cur.executemany(_pg_sql(sql), rows)
            return cur


def _password() -> str | None:
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path:
        return None  # libpq still reads PGPASSWORD / PGPASSFILE itself
    return Path(path).read_text().strip()


def check_pooled(conn: Any) -> None:
    """The pool's check as a call takes a connection: it raises for a dead one (the pool
    replaces it). A round trip only where the idle connection's socket has something to
    read: the server ends a session (restart, terminated backend) with a goodbye and
    EOF, both readable at once, while a live idle session's socket is silent. Pinging
    every connection taken cost one round trip per store call (a status read makes
    eight). A peer gone without a word fails the call after ``tcp_user_timeout``, as
    the ping would have."""
    from psycopg_pool import ConnectionPool

    if conn.closed or conn.broken:
        raise ConnectionError("the pooled connection is closed")
    poll = select.poll()  # not select(): descriptors past 1024 (max_connections)
    poll.register(conn.fileno(), select.POLLIN | select.POLLPRI)
    if poll.poll(0):
        ConnectionPool.check_connection(conn)


class PostgresEngine:
    dialect = "postgresql"
    now_sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"

    def __init__(self, url: str, limits: StoreLimits):
        from psycopg.conninfo import conninfo_to_dict
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        params = conninfo_to_dict(url)
        if params.get("password"):
            raise ItoError(
                ErrorCode.bad_request,
                "the database password must not be in the URL (argv); use "
                f"{PASSWORD_FILE_ENV}, PGPASSWORD or PGPASSFILE",
            )
        self.limits = s = limits
        self.outage = Outage(limits)
        password = _password()
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "row_factory": dict_row,
            "connect_timeout": max(2, math.ceil(s.connect_timeout_s)),
            "tcp_user_timeout": s.tcp_user_timeout_ms,
            "options": f"-c statement_timeout={s.statement_timeout_ms} "
            f"-c idle_in_transaction_session_timeout="
            f"{s.idle_in_transaction_timeout_ms}",
        }
        if password is not None:
            kwargs["password"] = password
        self._where = (
            f"postgresql://{params.get('host', '')}:{params.get('port', '')}/"
            f"{params.get('dbname', '')}"
        )
        self.pool = ConnectionPool(
            url,
            min_size=s.pool_min_size,
            max_size=s.pool_max_size,
            kwargs=kwargs,
            timeout=s.pool_wait_s,
            reconnect_timeout=s.reconnect_backoff_s,
            # A connection is checked as a call takes it: after the server restarted,
            # the pool's dead connections are replaced, not handed to a request.
            check=check_pooled,
            open=True,
            name="ito-store",
        )
        self.prepared = PreparedReads()
        try:
            self.pool.wait(timeout=max(s.connect_timeout_s, START_WAIT_S))
        except Exception as e:
            self.pool.close()
            raise unavailable(s, f"no connection to {self._where}") from e

    def describe(self) -> str:
        return self._where  # never the password

    @contextmanager
    def tx(self) -> Iterator[Conn]:
        with self.guarded(), self.pool.connection() as conn, conn.transaction():
            yield _PgConn(conn)

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        with self.guarded(), self.pool.connection() as conn:
            rows: list[Any] = conn.execute(_pg_sql(sql), tuple(params)).fetchall()
            return rows

    def read_batch(self, reads: Sequence[Read]) -> list[list[Row]]:
        """Every read in one round trip and one snapshot (``pg_batch.read_prepared``:
        the reads' statements prepared once per connection, run as ``EXECUTE``s in one
        read-only ``REPEATABLE READ`` transaction)."""
        if not reads:
            return []
        with self.guarded(), self.pool.connection() as conn:
            return read_prepared(conn, self.prepared, reads)

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """A server that cannot be reached (or a statement past its timeout) is
        store_unavailable; an unreachable one also makes calls fail fast for a while.
        A value PostgreSQL cannot store (a NUL byte in text) is validation_error."""
        import psycopg
        from psycopg import errors

        self.outage.check()
        try:
            yield
        except (errors.QueryCanceled, errors.LockNotAvailable) as e:
            raise unavailable(self.limits, "a statement ran past its timeout") from e
        except psycopg.OperationalError as e:  # the pool's timeout among them
            self.outage.tripped(f"{self._where} cannot be reached")
            raise unavailable(self.limits, self.outage.why) from e
        except psycopg.DataError as e:  # the API refuses such input first; never a 500
            raise ItoError(ErrorCode.validation_error, "a value the store cannot hold") from e
        else:
            self.outage.cleared()

    def retryable(self, e: BaseException) -> bool:
        from psycopg import errors

        return isinstance(
            e, errors.UniqueViolation | errors.SerializationFailure | errors.DeadlockDetected
        )

    def migration_lock(self, conn: Conn) -> None:
        # A migration may rewrite a large table: no statement timeout in its transaction.
        conn.execute("SET LOCAL statement_timeout = 0")
        conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_ID,))

    def close(self) -> None:
        with suppress(Exception):
            self.pool.close()


def open_engine(db: str | Path, limits: StoreLimits | None = None) -> SqliteEngine | PostgresEngine:
    limits = limits or StoreLimits()
    if is_postgres(db):
        return PostgresEngine(str(db), limits)
    return SqliteEngine(db, limits)
