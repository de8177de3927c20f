"""A booking's named nodes, their changes, and the resizes delivered to its runs.

``booking_nodes`` lists the nodes each booking holds (``held`` = 1 while the booking
is active: a partial unique index lets one node belong to one active booking at a
time, so two concurrent ``add-nodes`` cannot both take it). Every add and removal is
a row of ``booking_changes`` (numbered, timed): the supervisor resizes a running run
when its booking has a change newer than the run's last resize (``run_resizes``),
and the change's time is when the resize was requested. ``bookings.node_count``
stays equal to the held list's length.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrator.db.engines import Conn, Read, Row
from orchestrator.redact import safe_id
from stages.errors import ErrorCode, ItoError

_T = TypeVar("_T")

if TYPE_CHECKING:
    from contextlib import AbstractContextManager


class BookingNodes:
    """The store's booking-node and resize queries (mixed into ``Store``)."""

    if TYPE_CHECKING:

        def tx(self) -> AbstractContextManager[Conn]: ...
        def read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]: ...
        def read_one(self, sql: str, params: Iterable[Any] = ()) -> Row | None: ...
        def write(self, fn: Callable[[Conn], _T]) -> _T: ...

    # --- nodes -----------------------------------------------------------------------
    @staticmethod
    def insert_booking_nodes(c: Conn, booking_id: str, nodes: Iterable[str], now: float) -> None:
        """A new booking's nodes, in its registering transaction; refuses a node another
        active booking holds."""
        nodes = list(nodes)
        BookingNodes._check_free(c, booking_id, nodes)
        c.executemany(
            "INSERT INTO booking_nodes (booking_id, node, held, added_at) VALUES (?, ?, 1, ?)",
            [(booking_id, n, now) for n in nodes],
        )

    @staticmethod
    def _check_free(c: Conn, booking_id: str, nodes: list[str]) -> None:
        if not nodes:
            return
        marks = ",".join("?" * len(nodes))
        taken = c.execute(
            f"SELECT node, booking_id FROM booking_nodes WHERE held = 1 AND node IN ({marks}) "
            "AND booking_id != ? ORDER BY node",
            (*nodes, booking_id),
        ).fetchall()
        if taken:
            raise ItoError(
                ErrorCode.booking_node_taken,
                f"node {safe_id(taken[0]['node'])} is held by another active booking",
            )

    @staticmethod
    def set_nodes_held(c: Conn, booking_id: str, held: bool) -> None:
        """A booking leaving (or never in) ``active`` frees its nodes for others."""
        c.execute("UPDATE booking_nodes SET held = ? WHERE booking_id = ?", (int(held), booking_id))

    def booking_nodes(self, booking_id: str) -> list[str]:
        rows = self.read(
            "SELECT node FROM booking_nodes WHERE booking_id = ? ORDER BY added_at, node",
            (booking_id,),
        )
        return [r["node"] for r in rows]

    def change_booking_nodes(
        self, booking_id: str, action: str, nodes: list[str]
    ) -> dict[str, Any]:
        """Add (``action="add"``) or remove nodes of an active booking, in one
        transaction: the node list, ``node_count`` and a ``booking_changes`` row.
        Returns the change (``change_id``, ``ts``, ``node_count``, ``nodes``: the list
        after it)."""

        def apply(c: Conn) -> dict[str, Any]:
            row = c.execute(
                "SELECT state FROM bookings WHERE booking_id = ? FOR UPDATE", (booking_id,)
            ).fetchone()
            if row is None:
                raise ItoError(ErrorCode.booking_not_found, f"no booking {safe_id(booking_id)}")
            if row["state"] == "revoked":
                raise ItoError(ErrorCode.booking_revoked, "this booking was revoked")
            if row["state"] == "released":
                raise ItoError(ErrorCode.booking_released, "this booking was released")
            held = {
                r["node"]
                for r in c.execute(
                    "SELECT node FROM booking_nodes WHERE booking_id = ?", (booking_id,)
                ).fetchall()
            }
            now = time.time()
            if action == "add":
                dup = sorted(set(nodes) & held)
                if dup:
                    raise ItoError(
                        ErrorCode.booking_nodes_invalid,
                        f"the booking holds node {safe_id(dup[0])} already",
                    )
                self.insert_booking_nodes(c, booking_id, nodes, now)
            else:
                missing = [n for n in nodes if n not in held]
                if missing:
                    raise ItoError(
                        ErrorCode.booking_node_unknown,
                        f"the booking does not hold node {safe_id(missing[0])}",
                    )
                marks = ",".join("?" * len(nodes))
                c.execute(
                    f"DELETE FROM booking_nodes WHERE booking_id = ? AND node IN ({marks})",
                    (booking_id, *nodes),
                )
            count = len(held) + (len(nodes) if action == "add" else -len(nodes))
            c.execute(
                "UPDATE bookings SET node_count = ?, updated_at = ? WHERE booking_id = ?",
                (count, now, booking_id),
            )
            c.execute(
                "INSERT INTO booking_changes (booking_id, ts, action, nodes, node_count) "
                "VALUES (?, ?, ?, ?, ?)",
                (booking_id, now, action, json.dumps(nodes), count),
            )
            change = c.execute(
                "SELECT MAX(change_id) AS m FROM booking_changes WHERE booking_id = ?",
                (booking_id,),
            ).fetchone()
            return {"change_id": int(change["m"]), "ts": now, "node_count": count}

        # A lost race on the held-node index (PostgreSQL) runs again and then sees the
        # winner's node: ``booking_node_taken``.
        result: dict[str, Any] = self.write(apply)
        return {**result, "nodes": self.booking_nodes(booking_id)}

    def booking_changes(self, booking_id: str, after_change_id: int = 0) -> list[Row]:
        rows = self.read(
            "SELECT * FROM booking_changes WHERE booking_id = ? AND change_id > ? "
            "ORDER BY change_id",
            (booking_id, after_change_id),
        )
        return [{**r, "nodes": json.loads(r["nodes"])} for r in rows]

    # --- resizes of runs -------------------------------------------------------------
    def insert_resize(self, row: Row) -> None:
        """Record the supervisor's answer to a booking change: ``pending`` until the
        driver has it, then ``delivered`` (or ``superseded`` by a newer change first);
        ``refused`` (with its code) or ``unchanged`` (the same groups, no node gone)
        when nothing is sent. Idempotent on (run_id, request_id)."""
        with self.tx() as c:
            c.execute(
                "INSERT INTO run_resizes (run_id, request_id, change_id, requested_at, nodes, "
                "groups_before, replica_groups, reason, code, status, created_at, "
                "delivered_at) VALUES (:run_id, :request_id, :change_id, :requested_at, "
                ":nodes, :groups_before, :replica_groups, :reason, :code, :status, "
                ":created_at, NULL) ON CONFLICT (run_id, request_id) DO NOTHING",
                {**row, "nodes": json.dumps(list(row["nodes"])), "created_at": time.time()},
            )

    def mark_resize(self, run_id: str, request_id: str, status: str) -> None:
        """A pending resize ``delivered`` to the driver, or ``superseded`` by a newer
        change of the booking before it was."""
        with self.tx() as c:
            c.execute(
                "UPDATE run_resizes SET status = ?, delivered_at = ? "
                "WHERE run_id = ? AND request_id = ? AND status = 'pending'",
                (status, time.time() if status == "delivered" else None, run_id, request_id),
            )

    def run_resizes(self, run_id: str) -> list[Row]:
        return resize_rows(self.read(*run_resizes_read(run_id)))


# The read behind ``run_resizes``, also batched by the run's view (``run_view.py``).
def run_resizes_read(run_id: str) -> Read:
    return "SELECT * FROM run_resizes WHERE run_id = ? ORDER BY change_id, created_at", (run_id,)


def resize_rows(rows: list[Row]) -> list[Row]:
    return [{**r, "nodes": json.loads(r["nodes"])} for r in rows]
