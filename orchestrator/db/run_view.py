"""What a run's view (``GET /v1/runs/{id}``, ``ito status``) reads, in one batch.

A status poll is the API's most frequent request. Its rows (the run, its stage gates
and proposals, its latest progress, its eval and resize events, its resizes) come from
one ``read_batch``: one round trip to PostgreSQL instead of seven, all from one
snapshot, so a view never mixes a gate with a run state from before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.db.booking_nodes import resize_rows, run_resizes_read
from orchestrator.db.engines import Read, Row
from orchestrator.db.run_events import (
    event_rows,
    events_read,
    last_event_read,
    last_payload,
    proposals_read,
    stage_gates_read,
)
from orchestrator.redact import safe_id
from stages.errors import ErrorCode, ItoError

# The view's event kinds, read together (each a list in the view).
VIEW_EVENT_KINDS = ("eval", "resize")
# At most this many of them (the whole of any run this backend plans).
MAX_VIEW_EVENTS = 100_000


@dataclass(frozen=True)
class RunViewRows:
    run: Row
    stage_gates: list[Row]
    proposals: list[Row]
    progress: dict[str, Any] | None  # the newest "progress" event's payload
    eval_events: list[Row]
    resize_events: list[Row]
    resizes: list[Row]


def owned_run(run: Row | None, run_id: str, account_id: str | None) -> Row:
    """``run``, unless it is missing or (with ``account_id``) another account's:
    ``run_not_found`` either way, so a caller cannot tell the two apart."""
    if run is None or (account_id is not None and run["account_id"] != account_id):
        raise ItoError(ErrorCode.run_not_found, f"no run {safe_id(run_id)}")
    return run


def run_read(run_id: str) -> Read:
    return "SELECT * FROM runs WHERE run_id = ?", (run_id,)


def run_view_reads(run_id: str) -> list[Read]:
    return [
        run_read(run_id),
        stage_gates_read(run_id),
        proposals_read(run_id),
        last_event_read(run_id, "progress"),
        events_read(run_id, kinds=VIEW_EVENT_KINDS, limit=MAX_VIEW_EVENTS),
        run_resizes_read(run_id),
    ]


def run_view_rows(
    results: list[list[Row]], run_id: str, account_id: str | None = None
) -> RunViewRows:
    """The rows of ``run_view_reads``' batch, each read's answer as its query gives it;
    ``run_not_found`` as ``owned_run`` says."""
    run, gates, proposals, progress, events, resizes = results
    parsed = event_rows(events)
    return RunViewRows(
        run=owned_run(run[0] if run else None, run_id, account_id),
        stage_gates=gates,
        proposals=proposals,
        progress=last_payload(progress),
        eval_events=[e for e in parsed if e["kind"] == "eval"],
        resize_events=[e for e in parsed if e["kind"] == "resize"],
        resizes=resize_rows(resizes),
    )
