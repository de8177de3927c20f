"""A run's events, as its driver numbered them, and the tables derived from them:
logs (with their per-run cursor), checkpoints, stage gates and proposals.

``ingest_events`` is idempotent on (run, seq): the supervisor may pull an event twice
(a poll whose acknowledgement was lost) and the second copy changes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from orchestrator.db.engines import Conn, Read, Row
from orchestrator.redact import safe_id
from stages.errors import ErrorCode, ItoError
from stages.events import Event

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

_EVENT = TypeAdapter(Event)


# The reads (SQL and parameters) behind the queries below, also batched by the run's view
# (``orchestrator/db/run_view.py``), with what turns their rows into the queries' answers.
def events_read(
    run_id: str, after_seq: int = -1, kinds: Iterable[str] | None = None, limit: int = 10_000
) -> Read:
    sql, params = "SELECT * FROM run_events WHERE run_id = ? AND seq > ?", [run_id, after_seq]
    kinds = list(kinds or [])
    if kinds:
        sql += f" AND kind IN ({','.join('?' * len(kinds))})"
        params += kinds
    return sql + " ORDER BY seq LIMIT ?", [*params, limit]


def event_rows(rows: list[Row]) -> list[Row]:
    return [{**r, "payload": json.loads(r["payload"])} for r in rows]


def last_event_read(run_id: str, kind: str) -> Read:
    return (
        "SELECT payload FROM run_events WHERE run_id = ? AND kind = ? ORDER BY seq DESC LIMIT 1",
        (run_id, kind),
    )


def last_payload(rows: list[Row]) -> dict[str, Any] | None:
    return dict(json.loads(rows[0]["payload"])) if rows else None


def stage_gates_read(run_id: str) -> Read:
    return "SELECT * FROM stage_gates WHERE run_id = ? ORDER BY updated_at", (run_id,)


def proposals_read(run_id: str) -> Read:
    return "SELECT * FROM proposals WHERE run_id = ? ORDER BY created_at", (run_id,)


class RunEvents:
    """The store's run-event queries (mixed into ``Store``)."""

    if TYPE_CHECKING:

        def tx(self) -> AbstractContextManager[Conn]: ...
        def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]: ...
        def read_one(self, sql: str, params: Iterable[Any] = ()) -> Row | None: ...

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
            RunEvents.insert_log(c, run_id, seq, ev.ts, ev.level, ev.stage, ev.message)
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
        return event_rows(self.read(*events_read(run_id, after_seq, kinds, limit)))

    def last_event(self, run_id: str, kind: str) -> dict[str, Any] | None:
        """The payload of the run's newest event of this kind (e.g. "progress")."""
        return last_payload(self.read(*last_event_read(run_id, kind)))

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
        return self.read(*stage_gates_read(run_id))

    def list_proposals(self, run_id: str) -> list[Row]:
        return self.read(*proposals_read(run_id))

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
