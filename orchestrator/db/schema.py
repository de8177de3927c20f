"""The store's versioned schema: ordered migrations, each applied once, in order.

A migration is appended, never edited: ``schema_version`` records the highest
applied number, and a database newer than this code refuses to open. Both engines
run the same history; ``render`` maps SQLite's column types to PostgreSQL's
(``REAL`` is 8 bytes in SQLite and 4 in PostgreSQL, ``INTEGER`` 8 and 4).
"""

from __future__ import annotations

import re

MIGRATIONS: list[str] = [
    # 1: accounts, keys, bookings, confirmations, runs, idempotency, events, audit.
    """
    CREATE TABLE accounts (
        account_id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL
    );
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts(account_id),
        key_sha256 TEXT NOT NULL UNIQUE,
        scopes TEXT NOT NULL,
        created_at REAL NOT NULL,
        revoked_at REAL
    );
    CREATE TABLE bookings (
        booking_id TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts(account_id),
        gpu_sku TEXT,
        gpus_per_node INTEGER,
        node_count INTEGER,
        region TEXT,
        fabric TEXT,
        term_start REAL NOT NULL,
        term_end REAL NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('active', 'revoked', 'released')),
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE confirmations (
        ref_sha256 TEXT PRIMARY KEY,
        account_id TEXT NOT NULL,
        action TEXT NOT NULL,
        booking_id TEXT NOT NULL,
        manifest_digest TEXT,
        run_id TEXT,
        proposal_id TEXT,
        cost_usd REAL NOT NULL,
        created_by_key TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        consumed_at REAL,
        consumed_by TEXT
    );
    CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        account_id TEXT NOT NULL,
        booking_id TEXT NOT NULL,
        manifest_id TEXT NOT NULL,
        manifest_digest TEXT NOT NULL,
        manifest_json TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        request_sha256 TEXT NOT NULL,
        state TEXT NOT NULL,
        state_reason TEXT NOT NULL DEFAULT '',
        cost_estimate_usd REAL NOT NULL,
        plan TEXT,
        data_prep TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        UNIQUE (account_id, idempotency_key)
    );
    CREATE INDEX runs_state ON runs(state);
    CREATE TABLE idempotency (
        account_id TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        request_sha256 TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        response TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (account_id, idempotency_key)
    );
    CREATE TABLE run_events (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL,
        PRIMARY KEY (run_id, seq)
    );
    CREATE TABLE logs (
        log_id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL,
        seq INTEGER,
        ts REAL NOT NULL,
        level TEXT NOT NULL,
        stage TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX logs_run ON logs(run_id, log_id);
    CREATE TABLE checkpoints (
        run_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        path TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        blocking_s REAL NOT NULL,
        total_s REAL NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (run_id, step)
    );
    CREATE TABLE stage_gates (
        run_id TEXT NOT NULL,
        stage TEXT NOT NULL,
        status TEXT NOT NULL,
        reason TEXT NOT NULL,
        metrics TEXT NOT NULL,
        artifacts TEXT NOT NULL,
        error_code TEXT,
        updated_at REAL NOT NULL,
        PRIMARY KEY (run_id, stage)
    );
    CREATE TABLE proposals (
        run_id TEXT NOT NULL,
        proposal_id TEXT NOT NULL,
        action TEXT NOT NULL,
        description TEXT NOT NULL,
        params TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        decided_at REAL,
        PRIMARY KEY (run_id, proposal_id)
    );
    CREATE TABLE audit_events (
        audit_id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        account_id TEXT,
        key_id TEXT,
        action TEXT NOT NULL,
        gate TEXT NOT NULL,
        outcome TEXT NOT NULL CHECK (outcome IN ('pass', 'fail')),
        code TEXT,
        booking_id TEXT,
        run_id TEXT
    );
    """,
    # 2: tenant isolation: per-account data and checkpoint roots, disabled
    # accounts, counted (batched) audit rows, per-run log cursors.
    """
    CREATE TABLE account_roots (
        account_id TEXT NOT NULL REFERENCES accounts(account_id),
        kind TEXT NOT NULL CHECK (kind IN ('data', 'checkpoint')),
        path TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (account_id, kind, path)
    );
    ALTER TABLE accounts ADD COLUMN disabled_at REAL;
    ALTER TABLE audit_events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE logs ADD COLUMN run_seq INTEGER;
    UPDATE logs SET run_seq = (SELECT COUNT(*) FROM logs AS l2
                               WHERE l2.run_id = logs.run_id AND l2.log_id <= logs.log_id);
    CREATE UNIQUE INDEX logs_run_seq ON logs(run_id, run_seq);
    """,
    # 3: the supervisor's leader lease; ``token`` grows with every new holder (fencing).
    """
    CREATE TABLE leases (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        token INTEGER NOT NULL,
        expires_at REAL NOT NULL
    );
    """,
    # 4: a booking's named nodes and their changes; the resizes delivered to runs. A
    # node is held by one active booking at a time (the partial unique index). The
    # bookings of an older database get derived names, ``<booking_id>-n<i>``.
    """
    CREATE TABLE booking_nodes (
        booking_id TEXT NOT NULL REFERENCES bookings(booking_id),
        node TEXT NOT NULL,
        held INTEGER NOT NULL DEFAULT 1,
        added_at REAL NOT NULL,
        PRIMARY KEY (booking_id, node)
    );
    CREATE UNIQUE INDEX booking_nodes_held ON booking_nodes(node) WHERE held = 1;
    WITH RECURSIVE seq(i) AS (
        SELECT 0 UNION ALL SELECT i + 1 FROM seq
        WHERE i + 1 < (SELECT COALESCE(MAX(node_count), 0) FROM bookings)
    )
    INSERT INTO booking_nodes (booking_id, node, held, added_at)
    SELECT b.booking_id, b.booking_id || '-n' || CAST(seq.i AS TEXT),
           CASE WHEN b.state = 'active' THEN 1 ELSE 0 END, b.created_at
    FROM bookings b JOIN seq ON seq.i < COALESCE(b.node_count, 0);
    CREATE TABLE booking_changes (
        change_id INTEGER PRIMARY KEY AUTOINCREMENT,
        booking_id TEXT NOT NULL REFERENCES bookings(booking_id),
        ts REAL NOT NULL,
        action TEXT NOT NULL CHECK (action IN ('add', 'remove')),
        nodes TEXT NOT NULL,
        node_count INTEGER NOT NULL
    );
    CREATE INDEX booking_changes_booking ON booking_changes(booking_id, change_id);
    CREATE TABLE run_resizes (
        run_id TEXT NOT NULL,
        request_id TEXT NOT NULL,
        change_id INTEGER NOT NULL,
        requested_at REAL NOT NULL,
        nodes TEXT NOT NULL,
        groups_before INTEGER NOT NULL,
        replica_groups INTEGER NOT NULL,
        reason TEXT NOT NULL,
        code TEXT,
        status TEXT NOT NULL
            CHECK (status IN ('pending', 'delivered', 'refused', 'unchanged', 'superseded')),
        created_at REAL NOT NULL,
        delivered_at REAL,
        PRIMARY KEY (run_id, request_id)
    );
    CREATE INDEX run_resizes_run ON run_resizes(run_id, change_id);
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)

_PG_TYPES = (
    (
        re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"),
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    ),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
)


def render(migration: str, dialect: str) -> list[str]:
    """The migration's statements for one engine ("sqlite" or "postgresql")."""
    if dialect == "postgresql":
        for pattern, replacement in _PG_TYPES:
            migration = pattern.sub(replacement, migration)
    return [s for s in migration.split(";") if s.strip()]
