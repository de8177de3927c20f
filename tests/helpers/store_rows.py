"""Rows written straight into a real store, for tests of what reads them (the API's
views, the supervisor, authorization) without a submit in front."""

from __future__ import annotations

import time

from orchestrator.db.store import Store


def insert_run(
    store: Store,
    run_id: str,
    *,
    account_id: str = "acct",
    booking_id: str = "bk",
    idempotency_key: str | None = None,
    state: str = "accepted",
) -> None:
    """A run row as a submit leaves it (its manifest a stand-in: nothing here reads it)."""
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
                "manifest_json": "{}",
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
