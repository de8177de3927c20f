"""Rows written straight into a real store, for tests of what reads them (the API's
views, the supervisor, authorization) without a submit in front."""

from __future__ import annotations

import json
import time
from typing import Any

from orchestrator.db.store import Store


def insert_run(
    store: Store,
    run_id: str,
    *,
    account_id: str = "acct",
    booking_id: str = "bk",
    idempotency_key: str | None = None,
    state: str = "accepted",
    manifest: dict[str, Any] | None = None,
) -> None:
    """A run row as a submit leaves it (its manifest a stand-in unless given: the run
    view reads only its post-training recipe)."""
    now = time.time()
    with store.tx() as c:
        store.insert_run(
            c,
            {
                "run_id": run_id,
                "account_id": account_id,
                "booking_id": booking_id,
                "manifest_id": "mf_x",
                "manifest_digest": "d",
                "manifest_json": json.dumps(manifest or {}),
                "idempotency_key": idempotency_key or f"key-{run_id}",
                "request_sha256": "r",
                "state": state,
                "state_reason": "",
                "cost_estimate_usd": 0.0,
                "plan": None,
                "data_prep": None,
                "created_at": now,
                "updated_at": now,
            },
        )


def stage_run_view(
    store: Store, run_id: str, manifest: dict[str, Any], events: list[Any], *, state: str
) -> dict[str, Any]:
    """The API's view (``GET /v1/runs/{id}``) of a run of ``manifest`` in ``state`` whose
    stage emitted ``events`` (``stages.events`` models), as the supervisor stores them."""
    from orchestrator.api.deps import run_view

    insert_run(store, run_id, state=state, manifest=manifest)
    rows = [{**e.model_dump(mode="json"), "seq": i} for i, e in enumerate(events)]
    assert store.ingest_events(run_id, rows) == len(rows)
    return run_view(store, run_id)
