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
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from orchestrator.db.booking_nodes import BookingNodes
from orchestrator.db.engines import (
    Conn,
    Row,
    SqliteEngine,
    StoreLimits,
    is_postgres,
    open_engine,
)
from orchestrator.db.lease import Fence, Leases
from orchestrator.db.schema import MIGRATIONS, SCHEMA_VERSION, render
from orchestrator.redact import safe_id
from orchestrator.runs import ACTIVE, RunState, check_transition
from stages.errors import ErrorCode, ItoError
from stages.events import Event

__all__ = ["Conn", "Fence", "Row", "Store", "is_postgres", "new_id"]

_EVENT = TypeAdapter(Event)
RUN_FIELDS = ("plan", "data_prep")
# A write that lost a unique or serialisation race (PostgreSQL) runs again this often.
WRITE_ATTEMPTS = 5


def new_id(prefix: str, nbytes: int = 8) -> str:
    return f"{prefix}_{secrets.token_hex(nbytes)}"


class Store(BookingNodes, Leases):
    def __init__(self, path: str | Path, limits: StoreLimits | None = None):
        self.path = str(path)
        self.engine = open_engine(path, limits)
        self.dialect = self.engine.dialect
        self._fence: Fence | None = None
        # Counted audit rows waiting for their window: (gate, action, code) -> count.
        self._counted: dict[tuple[str, str, str], int] = {}
        self._counted_since = time.monotonic()
        self._counted_lock = threading.Lock()
        self.counted_window_s = 5.0  # the server sets Settings.auth_fail_audit_window_s
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
        row = self.read_one("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        if row is None or (account_id is not None and row["account_id"] != account_id):
            raise ItoError(ErrorCode.run_not_found, f"no run {safe_id(run_id)}")
        return row

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

    # --- events and their derived tables ---------------------------------------------
    def ingest_events(self, run_id: str, events: list[dict[str, Any]]) -> int:
        """Persist driver events; idempotent on (run_id, seq). Returns how many were new."""
        parsed: list[tuple[int, Any]] = []
        for raw in events:
            body = {k: v for k, v in raw.items() if k != "seq"}
            try:
                seq = int(raw["seq"])
                parsed.append((seq, _EVENT.validate_python(body)))
            except (KeyError, TypeError, ValueError, ValidationError) as e:
                raise ItoError(
                    ErrorCode.bad_request,
                    f"malformed event for {safe_id(run_id)}: {type(e).__name__}",
                ) from None
        added = 0
        with self.tx() as c:
            # The run's row lock orders this run's writers (its per-run log counter).
            if not c.execute(
                "SELECT 1 FROM runs WHERE run_id = ? FOR UPDATE", (run_id,)
            ).fetchone():
                raise ItoError(ErrorCode.run_not_found, f"no run {safe_id(run_id)}")
            for seq, ev in parsed:
                cur = c.execute(
                    "INSERT INTO run_events VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id, seq) DO NOTHING",
                    (run_id, seq, ev.ts, ev.kind, ev.model_dump_json()),
                )
                if cur.rowcount != 1:
                    continue
                added += 1
                self._derive(c, run_id, seq, ev)
        return added

    @staticmethod
    def _derive(c: Conn, run_id: str, seq: int, ev: Any) -> None:
        if ev.kind == "log":
            Store.insert_log(c, run_id, seq, ev.ts, ev.level, ev.stage, ev.message)
        elif ev.kind == "checkpoint":
            c.execute(
                "INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, step) DO UPDATE SET path = excluded.path, "
                "bytes = excluded.bytes, blocking_s = excluded.blocking_s, "
                "total_s = excluded.total_s, created_at = excluded.created_at",
                (run_id, ev.step, ev.path, ev.bytes, ev.blocking_s, ev.total_s, ev.ts),
            )
        elif ev.kind == "stage_result":
            o = ev.outcome
            c.execute(
                "INSERT INTO stage_gates VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, stage) DO UPDATE SET status = excluded.status, "
                "reason = excluded.reason, metrics = excluded.metrics, "
                "artifacts = excluded.artifacts, error_code = excluded.error_code, "
                "updated_at = excluded.updated_at",
                (
                    run_id,
                    str(o.get("stage") or ev.stage),
                    str(o.get("status", "")),
                    str(o.get("reason", "")),
                    json.dumps(o.get("metrics") or {}),
                    json.dumps(o.get("artifacts") or {}),
                    o.get("error_code"),
                    ev.ts,
                ),
            )
        elif ev.kind == "proposal":
            c.execute(
                "INSERT INTO proposals VALUES (?, ?, ?, ?, ?, 'pending', ?, NULL) "
                "ON CONFLICT (run_id, proposal_id) DO NOTHING",
                (run_id, ev.proposal_id, ev.action, ev.description, json.dumps(ev.params), ev.ts),
            )

    def list_events(
        self,
        run_id: str,
        after_seq: int = -1,
        kinds: Iterable[str] | None = None,
        limit: int = 10_000,
    ) -> list[Row]:
        sql, params = "SELECT * FROM run_events WHERE run_id = ? AND seq > ?", [run_id, after_seq]
        kinds = list(kinds or [])
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            params += kinds
        rows = self.read(sql + " ORDER BY seq LIMIT ?", [*params, limit])
        return [{**r, "payload": json.loads(r["payload"])} for r in rows]

    def last_event(self, run_id: str, kind: str) -> dict[str, Any] | None:
        """The payload of the run's newest event of this kind (e.g. "progress")."""
        row = self.read_one(
            "SELECT payload FROM run_events WHERE run_id = ? AND kind = ? "
            "ORDER BY seq DESC LIMIT 1",
            (run_id, kind),
        )
        return None if row is None else dict(json.loads(row["payload"]))

    def max_seq(self, run_id: str) -> int:
        row = self.read_one("SELECT MAX(seq) AS m FROM run_events WHERE run_id = ?", (run_id,))
        return -1 if row is None or row["m"] is None else int(row["m"])

    def list_logs(self, run_id: str, cursor: int, limit: int) -> list[Row]:
        """Logs after ``cursor``, a per-run counter (it reveals nothing of other runs)."""
        return self.read(
            "SELECT * FROM logs WHERE run_id = ? AND run_seq > ? ORDER BY run_seq LIMIT ?",
            (run_id, cursor, limit),
        )

    def add_log(
        self, run_id: str, message: str, level: str = "info", stage: str = "orchestrator"
    ) -> None:
        with self.tx() as c:
            self.insert_log(c, run_id, None, time.time(), level, stage, message)

    @staticmethod
    def insert_log(
        c: Conn, run_id: str, seq: int | None, ts: float, level: str, stage: str, message: str
    ) -> None:
        """One log line; ``run_seq`` counts per run (the public cursor). The run's row
        lock serialises the run's log writers, so two never compute one ``run_seq``."""
        c.execute("SELECT 1 FROM runs WHERE run_id = ? FOR UPDATE", (run_id,))
        c.execute(
            "INSERT INTO logs (run_id, seq, ts, level, stage, message, run_seq) "
            "VALUES (?, ?, ?, ?, ?, ?, (SELECT COALESCE(MAX(run_seq), 0) + 1 "
            "FROM logs WHERE run_id = ?))",
            (run_id, seq, ts, level, stage, message, run_id),
        )

    def list_checkpoints(self, run_id: str) -> list[Row]:
        return self.read("SELECT * FROM checkpoints WHERE run_id = ? ORDER BY step", (run_id,))

    def list_stage_gates(self, run_id: str) -> list[Row]:
        return self.read(
            "SELECT * FROM stage_gates WHERE run_id = ? ORDER BY updated_at", (run_id,)
        )

    def list_proposals(self, run_id: str) -> list[Row]:
        return self.read("SELECT * FROM proposals WHERE run_id = ? ORDER BY created_at", (run_id,))

    @staticmethod
    def decide_proposal(c: Conn, run_id: str, proposal_id: str, decision: str) -> None:
        row = c.execute(
            "SELECT status FROM proposals WHERE run_id = ? AND proposal_id = ?",
            (run_id, proposal_id),
        ).fetchone()
        if row is None:
            raise ItoError(ErrorCode.proposal_not_found, f"no proposal {safe_id(proposal_id)}")
        if row["status"] != "pending":
            raise ItoError(ErrorCode.invalid_state, f"proposal already {row['status']}")
        c.execute(
            "UPDATE proposals SET status = ?, decided_at = ? WHERE run_id = ? AND proposal_id = ?",
            (decision, time.time(), run_id, proposal_id),
        )

    # --- audit -----------------------------------------------------------------------
    @staticmethod
    def audit_rows(c: Conn, rows: list[Row]) -> None:
        """Gate decisions: only ids and codes, never a message, body or secret."""
        c.executemany(
            "INSERT INTO audit_events (ts, account_id, key_id, action, gate, outcome, code, "
            "booking_id, run_id, count) VALUES (:ts, :account_id, :key_id, :action, :gate, "
            ":outcome, :code, :booking_id, :run_id, :count)",
            [{"count": 1, **r} for r in rows],
        )

    def audit(self, rows: list[Row]) -> None:
        if rows:
            with self.tx() as c:
                self.audit_rows(c, rows)

    def audit_counted(
        self, action: str, code: str, window_s: float | None = None, gate: str = "auth"
    ) -> None:
        """Audit a cheap, frequent failure (bad key, rate limited, malformed input) as one
        counted row per (gate, action, code) per window: a flood costs one write
        transaction per window."""
        with self._counted_lock:
            key = (gate, action, code)
            self._counted[key] = self._counted.get(key, 0) + 1
            window = self.counted_window_s if window_s is None else window_s
            due = time.monotonic() - self._counted_since >= window
        if due:
            self.flush_counted()

    def flush_counted(self) -> None:
        """Write the counted rows; while the store is unavailable they wait (counted on)
        for the next window: a refusal never fails for want of its audit row."""
        with self._counted_lock:
            pending, self._counted = self._counted, {}
            self._counted_since = time.monotonic()
        if not pending:
            return
        try:
            self._write_counted(pending)
        except ItoError as e:
            if e.code != ErrorCode.store_unavailable:
                raise
            with self._counted_lock:
                for key, n in pending.items():
                    self._counted[key] = self._counted.get(key, 0) + n

    def _write_counted(self, pending: dict[tuple[str, str, str], int]) -> None:
        if pending:
            now = time.time()
            self.audit(
                [
                    {
                        "ts": now,
                        "account_id": None,
                        "key_id": None,
                        "action": action,
                        "gate": gate,
                        "outcome": "fail",
                        "code": code,
                        "booking_id": None,
                        "run_id": None,
                        "count": n,
                    }
                    for (gate, action, code), n in pending.items()
                ]
            )

    def audit_events(self, limit: int = 1000) -> list[Row]:
        return self.read("SELECT * FROM audit_events ORDER BY audit_id DESC LIMIT ?", (limit,))

    def write(self, fn: Callable[[Conn], Any]) -> Any:
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
