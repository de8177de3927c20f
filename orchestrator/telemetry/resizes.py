"""A run's resizes as people read them (``ito status``, ``GET /v1/runs/{id}``).

Each is the supervisor's answer to a booking change (``run_resizes``: delivered,
pending, refused with its code, or unchanged) joined with the trainer's latest
report of it (``ResizeEvent``: requested, applied with the seconds from the booking
change to the first step with the new group count, refused, or paused).
"""

from __future__ import annotations

from typing import Any

from orchestrator.db.engines import Row
from orchestrator.gates.bookings import iso

# The newest resizes shown (a run resized more often lists these).
MAX_LISTED_RESIZES = 50


def resize_history(events: list[Row], resizes: list[Row]) -> list[dict[str, Any]]:
    """The run's ``resize`` events joined with its ``run_resizes`` rows (both in order)."""
    reports: dict[str, dict[str, Any]] = {}
    for ev in events:
        reports[ev["payload"]["request_id"]] = ev["payload"]
    history = []
    for r in resizes[-MAX_LISTED_RESIZES:]:
        report = reports.get(r["request_id"]) or {}
        history.append(
            {
                "request_id": r["request_id"],
                "requested_at": iso(r["requested_at"]),
                "groups_before": r["groups_before"],
                "groups_after": report.get("groups_after", r["replica_groups"]),
                "nodes": len(r["nodes"]),
                # The trainer's word once it has one; until then the supervisor's.
                "status": report.get("action") or r["status"],
                "seconds": report.get("seconds"),
                "step": report.get("step"),
                "code": r["code"],
                "reason": report.get("reason") or r["reason"],
            }
        )
    return history
