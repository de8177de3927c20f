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

The password never travels in argv: a ``postgresql://`` URL with a password is
refused; libpq's own ``PGPASSWORD`` / ``PGPASSFILE`` work, and
``ITO_DB_PASSWORD_FILE`` names a file holding only the password (a mounted secret).
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from stages.errors import ErrorCode, ItoError

Row = dict[str, Any]
WAL_RETRY_S = 0.01
PASSWORD_FILE_ENV = "ITO_DB_PASSWORD_FILE"
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
# Serialises the first migration of a fresh PostgreSQL database across replicas.
MIGRATION_LOCK_ID = 0x17_0_0_5
_LOCK_CLAUSE = re.compile(r"\s+FOR\s+(UPDATE|SHARE)\b")


def is_postgres(db: str | Path) -> bool:
    return isinstance(db, str) and db.startswith(POSTGRES_SCHEMES)


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

    def retryable(self, e: BaseException) -> bool: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...


# --- SQLite ---------------------------------------------------------------------------
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

    def __init__(self, path: str | Path, busy_timeout_ms: int):
        self.path = str(path)
        self.busy_timeout_ms = busy_timeout_ms
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
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield _SqliteConn(conn)
            conn.execute("COMMIT")
        except BaseException:
            # Also after a failed COMMIT: never leave the thread's connection mid-transaction.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        rows: list[Row] = self._conn().execute(_sqlite_sql(sql), tuple(params)).fetchall()
        return rows

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


class PostgresSettings:
    """How the pool connects; every bound is named."""

    def __init__(
        self,
        *,
        min_size: int = 1,
        max_size: int = 16,
        connect_timeout_s: int = 10,
        pool_timeout_s: float = 30.0,
        statement_timeout_ms: int = 30_000,
        idle_in_transaction_timeout_ms: int = 5_000,
    ):
        self.min_size, self.max_size = min_size, max_size
        self.connect_timeout_s = connect_timeout_s
        self.pool_timeout_s = pool_timeout_s
        self.statement_timeout_ms = statement_timeout_ms
        # A process paused (SIGSTOP) or partitioned inside a transaction keeps its row
        # locks (a lease row among them) until the server ends its session: this bounds
        # it, well inside the supervisor lease.
        self.idle_in_transaction_timeout_ms = idle_in_transaction_timeout_ms


def _password() -> str | None:
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path:
        return None  # libpq still reads PGPASSWORD / PGPASSFILE itself
    return Path(path).read_text().strip()


class PostgresEngine:
    dialect = "postgresql"
    now_sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"

    def __init__(self, url: str, settings: PostgresSettings | None = None):
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
        s = settings or PostgresSettings()
        password = _password()
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "row_factory": dict_row,
            "connect_timeout": s.connect_timeout_s,
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
            min_size=s.min_size,
            max_size=s.max_size,
            kwargs=kwargs,
            timeout=s.pool_timeout_s,
            open=True,
            name="ito-store",
        )
        self.pool.wait(timeout=s.pool_timeout_s)

    def describe(self) -> str:
        return self._where  # never the password

    @contextmanager
    def tx(self) -> Iterator[Conn]:
        with self.pool.connection() as conn, conn.transaction():
            yield _PgConn(conn)

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        with self.pool.connection() as conn:
            rows: list[Any] = conn.execute(_pg_sql(sql), tuple(params)).fetchall()
            return rows

    def retryable(self, e: BaseException) -> bool:
        from psycopg import errors

        return isinstance(
            e, errors.UniqueViolation | errors.SerializationFailure | errors.DeadlockDetected
        )

    def migration_lock(self, conn: Conn) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_ID,))

    def close(self) -> None:
        with suppress(Exception):
            self.pool.close()


def open_engine(db: str | Path, *, busy_timeout_ms: int = 10_000) -> SqliteEngine | PostgresEngine:
    if is_postgres(db):
        return PostgresEngine(str(db))
    return SqliteEngine(db, busy_timeout_ms)
