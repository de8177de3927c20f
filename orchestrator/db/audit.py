"""The audit log: gate decisions with ids and codes only (never a message, a body
or a secret), and frequent cheap failures counted into one row per window."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from orchestrator.db.engines import Conn, Row
from stages.errors import ErrorCode, ItoError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager


class AuditLog:
    """The store's audit writes and reads (mixed into ``Store``)."""

    if TYPE_CHECKING:

        def tx(self) -> AbstractContextManager[Conn]: ...
        def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]: ...
        def read_one(self, sql: str, params: Iterable[Any] = ()) -> Row | None: ...

    def _start_counting(self) -> None:
        # Counted audit rows waiting for their window: (gate, action, code) -> count.
        self._counted: dict[tuple[str, str, str], int] = {}
        self._counted_since = time.monotonic()
        self._counted_lock = threading.Lock()
        self.counted_window_s = 5.0  # the server sets Settings.auth_fail_audit_window_s

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
