"""The store: every durable fact of the control plane, on SQLite or PostgreSQL.

SQLite (a file path) is the embedded default; PostgreSQL (a ``postgresql://`` URL)
lets several API replicas share one store (``orchestrator/db/engines.py`` says how
each engine makes a transaction). Every write is one explicit transaction, so a
reader never sees half a mutation; what must happen once (an idempotency key's
run, a confirmation's use, a lease holder's write) is decided by a unique
constraint or a row lock inside that transaction, never by a lock in one process.
The supervisor calls ``ingest_events`` / ``transition`` / ``runs_in_states`` /
``set_run_field`` through a fenced view (``fenced``); the API calls the rest.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from orchestrator.db.audit import AuditLog
from orchestrator.db.booking_nodes import BookingNodes
from orchestrator.db.engines import (
    Conn,
    Read,
    Row,
    SqliteEngine,
    StoreLimits,
    is_postgres,
    open_engine,
)
from orchestrator.db.lease import Fence, Leases
from orchestrator.db.run_events import RunEvents
from orchestrator.db.run_view import (
    RunViewRows,
    owned_run,
    run_read,
    run_view_reads,
    run_view_rows,
)
from orchestrator.db.schema import MIGRATIONS, SCHEMA_VERSION, render
from orchestrator.redact import safe_id
from orchestrator.runs import ACTIVE, RunState, check_transition
from stages.errors import ErrorCode, ItoError

_T = TypeVar("_T")

__all__ = ["Conn", "Fence", "Row", "Store", "is_postgres", "new_id"]

RUN_FIELDS = ("plan", "data_prep")
# A write that lost a unique or serialisation race (PostgreSQL) runs again this often.
WRITE_ATTEMPTS = 5


def new_id(prefix: str, nbytes: int = 8) -> str:
    return f"{prefix}_{secrets.token_hex(nbytes)}"


class Store(RunEvents, AuditLog, BookingNodes, Leases):
    def __init__(self, path: str | Path, limits: StoreLimits | None = None):
        self.path = str(path)
        self.engine = open_engine(path, limits)
        self.dialect = self.engine.dialect
        self._fence: Fence | None = None
        self._start_counting()
        self._migrate()

    def describe(self) -> str:
        """Where the store is, safe to log (a URL never carries the password)."""
        return self.engine.describe()

    # --- transactions ----------------------------------------------------------------
    @contextmanager
    def tx(self) -> Iterator[Conn]:
        """One write transaction. In a fenced view it first checks the lease (and holds
        it shared until commit, so no takeover interleaves with this write)."""
        with self.engine.tx() as conn:
            if self._fence is not None:
                self._check_fence(conn, self._fence)
            yield conn

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        return self.engine.read(sql, params)

    def read_batch(self, reads: Sequence[Read]) -> list[list[Row]]:
        return self.engine.read_batch(reads)

    def read_one(self, sql: str, params: Iterable[Any] = ()) -> Row | None:
        rows = self.read(sql, params)
        return rows[0] if rows else None

    def _one(self, conn: Conn | None, sql: str, params: Iterable[Any]) -> Row | None:
        if conn is None:
            return self.read_one(sql, params)
        row: Row | None = conn.execute(sql, tuple(params)).fetchone()
        return row

    def close(self) -> None:
        with suppress(Exception):
            self.flush_counted()
        self.engine.close()

    def _migrate(self) -> None:
        """Apply pending migrations in one write transaction: two processes opening a
        fresh store at once serialise here, and the second finds nothing to do."""
        with self.engine.tx() as c:
            if not isinstance(self.engine, SqliteEngine):
                self.engine.migration_lock(c)
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = c.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                c.execute("INSERT INTO schema_version VALUES (0)")
            version = int(row["version"]) if row else 0
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"database schema {version} is newer than this code "
                    f"({SCHEMA_VERSION}); upgrade ito-train"
                )
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in render(MIGRATIONS[number - 1], self.dialect):
                    c.execute(statement)
                c.execute("UPDATE schema_version SET version = ?", (number,))

    def schema_version(self) -> int:
        row = self.read_one("SELECT version FROM schema_version")
        return int(row["version"]) if row else 0

    # --- accounts and keys -----------------------------------------------------------
    def create_account(self, name: str) -> Row:
        row = {"account_id": new_id("acct"), "name": name, "created_at": time.time()}
        with self.tx() as c:
            if c.execute("SELECT 1 FROM accounts WHERE name = ?", (name,)).fetchone():
                raise ItoError(ErrorCode.bad_request, f"account {name!r} already exists")
            c.execute(
                "INSERT INTO accounts (account_id, name, created_at) "
                "VALUES (:account_id, :name, :created_at)",
                row,
            )
        return row

    def disable_account(self, name: str) -> bool:
        """Disable an account: its keys stop authenticating and the confirmations its
        keys made can no longer be consumed (checked in the consuming transaction)."""
        with self.tx() as c:
            cur = c.execute(
                "UPDATE accounts SET disabled_at = ? WHERE name = ? AND disabled_at IS NULL",
                (time.time(), name),
            )
            return cur.rowcount == 1

    def set_roots(self, account_id: str, kind: str, paths: list[str]) -> None:
        """Replace the account's roots of one kind ('data' or 'checkpoint')."""
        with self.tx() as c:
            c.execute(
                "DELETE FROM account_roots WHERE account_id = ? AND kind = ?", (account_id, kind)
            )
            c.executemany(
                "INSERT INTO account_roots VALUES (?, ?, ?, ?)",
                [(account_id, kind, p, time.time()) for p in paths],
            )

    def roots(self, account_id: str, kind: str) -> tuple[str, ...]:
        rows = self.read(
            "SELECT path FROM account_roots WHERE account_id = ? AND kind = ? ORDER BY path",
            (account_id, kind),
        )
        return tuple(r["path"] for r in rows)

    def account_by_name(self, name: str) -> Row | None:
        return self.read_one("SELECT * FROM accounts WHERE name = ?", (name,))

    def account(self, account_id: str) -> Row | None:
        return self.read_one("SELECT * FROM accounts WHERE account_id = ?", (account_id,))

    def insert_key(self, key_id: str, account_id: str, key_sha256: str, scopes: list[str]) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, NULL)",
                (key_id, account_id, key_sha256, " ".join(sorted(scopes)), time.time()),
            )

    def key_by_hash(self, key_sha256: str) -> Row | None:
        """The key with its account's ``account_name`` (None: no such account) and
        ``account_disabled_at``: one query, since every request authenticates."""
        return self.read_one(
            "SELECT k.*, a.name AS account_name, a.disabled_at AS account_disabled_at "
            "FROM api_keys k LEFT JOIN accounts a ON a.account_id = k.account_id "
            "WHERE k.key_sha256 = ?",
            (key_sha256,),
        )

    def revoke_key(self, key_id: str) -> bool:
        with self.tx() as c:
            cur = c.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                (time.time(), key_id),
            )
            return cur.rowcount == 1

    # --- bookings --------------------------------------------------------------------
    def add_booking(self, b: Row) -> None:
        now = time.time()
        with self.tx() as c:
            if c.execute(
                "SELECT 1 FROM bookings WHERE booking_id = ?", (b["booking_id"],)
            ).fetchone():
                raise ItoError(
                    ErrorCode.booking_exists, f"booking {safe_id(b['booking_id'])} exists"
                )
            c.execute(
                "INSERT INTO bookings VALUES (:booking_id, :account_id, :gpu_sku, "
                ":gpus_per_node, :node_count, :region, :fabric, :term_start, :term_end, "
                "'active', :now, :now)",
                {**b, "now": now},
            )
            self.insert_booking_nodes(c, b["booking_id"], b.get("nodes") or (), now)

    def booking(self, booking_id: str) -> Row | None:
        return self.read_one("SELECT * FROM bookings WHERE booking_id = ?", (booking_id,))

    def set_booking_state(self, booking_id: str, state: str, conn: Conn | None = None) -> None:
        def apply(c: Conn) -> None:
            cur = c.execute(
                "UPDATE bookings SET state = ?, updated_at = ? WHERE booking_id = ?",
                (state, time.time(), booking_id),
            )
            if cur.rowcount != 1:
                raise ItoError(ErrorCode.booking_not_found, f"no booking {safe_id(booking_id)}")
            self.set_nodes_held(c, booking_id, state == "active")

        if conn is not None:
            apply(conn)
            return
        with self.tx() as c:
            apply(c)

    # --- confirmations ---------------------------------------------------------------
    def insert_confirmation(self, row: Row) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO confirmations VALUES (:ref_sha256, :account_id, :action, "
                ":booking_id, :manifest_digest, :run_id, :proposal_id, :cost_usd, "
                ":created_by_key, :created_at, :expires_at, NULL, NULL)",
                row,
            )

    def confirmation(self, ref_sha256: str, conn: Conn | None = None) -> Row | None:
        # In a transaction the row is locked: concurrent users of one confirmation
        # queue here, and each next one sees the previous one's outcome.
        if conn is None:
            return self.read_one("SELECT * FROM confirmations WHERE ref_sha256 = ?", (ref_sha256,))
        return self._one(
            conn, "SELECT * FROM confirmations WHERE ref_sha256 = ? FOR UPDATE", (ref_sha256,)
        )

    @staticmethod
    def consume_confirmation(c: Conn, ref_sha256: str, by: str) -> None:
        cur = c.execute(
            "UPDATE confirmations SET consumed_at = ?, consumed_by = ? "
            "WHERE ref_sha256 = ? AND consumed_at IS NULL",
            (time.time(), by, ref_sha256),
        )
        if cur.rowcount != 1:
            raise ItoError(ErrorCode.confirmation_consumed, "confirmation already used")

    # --- runs ------------------------------------------------------------------------
    def run_by_key(self, account_id: str, key: str, conn: Conn | None = None) -> Row | None:
        return self._one(
            conn,
            "SELECT * FROM runs WHERE account_id = ? AND idempotency_key = ?",
            (account_id, key),
        )

    @staticmethod
    def insert_run(c: Conn, run: Row) -> None:
        c.execute(
            "INSERT INTO runs (run_id, account_id, booking_id, manifest_id, manifest_digest, "
            "manifest_json, idempotency_key, request_sha256, state, state_reason, "
            "cost_estimate_usd, plan, data_prep, created_at, updated_at) VALUES (:run_id, "
            ":account_id, :booking_id, :manifest_id, :manifest_digest, :manifest_json, "
            ":idempotency_key, :request_sha256, :state, :state_reason, :cost_estimate_usd, "
            ":plan, :data_prep, :created_at, :updated_at)",
            run,
        )

    @staticmethod
    def count_active_runs(c: Conn, account_id: str) -> int:
        """The account's active runs, counted under its row lock: concurrent submits of
        one account queue here on PostgreSQL (SQLite has one writer), so a cap holds."""
        c.execute(
            "SELECT account_id FROM accounts WHERE account_id = ? FOR UPDATE", (account_id,)
        ).fetchone()
        marks = ",".join("?" * len(ACTIVE))
        row = c.execute(
            f"SELECT COUNT(*) AS n FROM runs WHERE account_id = ? AND state IN ({marks})",
            (account_id, *map(str, ACTIVE)),
        ).fetchone()
        return int(row["n"])

    def get_run(self, run_id: str, account_id: str | None = None) -> Row:
        """The run; with ``account_id``, another tenant's run is ``run_not_found`` too."""
        return owned_run(self.read_one(*run_read(run_id)), run_id, account_id)

    def run_view_rows(self, run_id: str, account_id: str | None = None) -> RunViewRows:
        """The run (as ``get_run``) and every row of its view, in one batch."""
        return run_view_rows(self.read_batch(run_view_reads(run_id)), run_id, account_id)

    def run_manifest(self, run_id: str) -> dict[str, Any]:
        """The run's stored manifest (exactly the bytes that passed the gates, secret-free)."""
        data: dict[str, Any] = json.loads(self.get_run(run_id)["manifest_json"])
        return data

    def runs_in_states(self, states: Iterable[RunState | str]) -> list[Row]:
        wanted = [str(RunState(s)) for s in states]
        if not wanted:
            return []
        marks = ",".join("?" * len(wanted))
        return self.read(f"SELECT * FROM runs WHERE state IN ({marks}) ORDER BY created_at", wanted)

    def transition(
        self, run_id: str, to_state: RunState | str, reason: str = "", conn: Conn | None = None
    ) -> Row:
        """Move a run along the one transition table; anything else is ``invalid_state``."""

        def apply(c: Conn) -> Row:
            row = c.execute("SELECT * FROM runs WHERE run_id = ? FOR UPDATE", (run_id,)).fetchone()
            if row is None:
                raise ItoError(ErrorCode.run_not_found, f"no run {safe_id(run_id)}")
            check_transition(row["state"], to_state)
            now = time.time()
            c.execute(
                "UPDATE runs SET state = ?, state_reason = ?, updated_at = ? WHERE run_id = ?",
                (str(RunState(to_state)), reason, now, run_id),
            )
            self.insert_log(
                c,
                run_id,
                None,
                now,
                "info",
                "orchestrator",
                f"state {row['state']} -> {RunState(to_state)}" + (f": {reason}" if reason else ""),
            )
            return {
                **row,
                "state": str(RunState(to_state)),
                "state_reason": reason,
                "updated_at": now,
            }

        if conn is not None:
            return apply(conn)
        with self.tx() as c:
            return apply(c)

    def set_state_reason(self, run_id: str, reason: str) -> bool:
        """Say why a run is still in its state (e.g. waiting for its booking's nodes);
        logged once per change. Returns whether the reason changed."""
        with self.tx() as c:
            row = c.execute(
                "SELECT state_reason FROM runs WHERE run_id = ? FOR UPDATE", (run_id,)
            ).fetchone()
            if row is None:
                raise ItoError(ErrorCode.run_not_found, f"no run {safe_id(run_id)}")
            if row["state_reason"] == reason:
                return False
            now = time.time()
            c.execute(
                "UPDATE runs SET state_reason = ?, updated_at = ? WHERE run_id = ?",
                (reason, now, run_id),
            )
            self.insert_log(c, run_id, None, now, "info", "orchestrator", reason)
            return True

    def set_run_field(self, run_id: str, **fields: Any) -> None:
        """Store structured run facts (``plan=``, ``data_prep=``) as JSON."""
        unknown = set(fields) - set(RUN_FIELDS)
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        with self.tx() as c:
            for name, value in fields.items():
                cur = c.execute(
                    f"UPDATE runs SET {name} = ?, updated_at = ? WHERE run_id = ?",
                    (json.dumps(value), time.time(), run_id),
                )
                if cur.rowcount != 1:
                    raise ItoError(ErrorCode.run_not_found, f"no run {safe_id(run_id)}")

    # --- idempotency records of other mutations -------------------------------------
    @staticmethod
    def idempotency_record(c: Conn, account_id: str, key: str) -> Row | None:
        row: Row | None = c.execute(
            "SELECT * FROM idempotency WHERE account_id = ? AND idempotency_key = ?",
            (account_id, key),
        ).fetchone()
        return row

    def get_idempotency(self, account_id: str, key: str) -> Row | None:
        return self.read_one(
            "SELECT * FROM idempotency WHERE account_id = ? AND idempotency_key = ?",
            (account_id, key),
        )

    @staticmethod
    def insert_idempotency(
        c: Conn,
        account_id: str,
        key: str,
        request_sha256: str,
        action: str,
        target: str,
        response: Any = None,
    ) -> None:
        c.execute(
            "INSERT INTO idempotency VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                account_id,
                key,
                request_sha256,
                action,
                target,
                None if response is None else json.dumps(response),
                time.time(),
            ),
        )

    def set_idempotency_response(self, account_id: str, key: str, response: Any) -> None:
        with self.tx() as c:
            c.execute(
                "UPDATE idempotency SET response = ? WHERE account_id = ? AND idempotency_key = ?",
                (json.dumps(response), account_id, key),
            )

    def write(self, fn: Callable[[Conn], _T]) -> _T:
        """Run ``fn`` inside one write transaction and return its result. A transaction
        that lost a race on a unique constraint (two replicas reserving one key) is
        rolled back and ``fn`` runs again: it then sees the winner's committed row."""
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                with self.tx() as c:
                    return fn(c)
            except Exception as e:
                if attempt == WRITE_ATTEMPTS or not self.engine.retryable(e):
                    raise
        raise AssertionError("unreachable")
