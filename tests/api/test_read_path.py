"""A status read asks the store only what it needs: authenticating a key is one query
(the key with its account), the run's view one batch (one round trip on PostgreSQL),
and no statement runs twice in one read (the run's view takes its account's name
from the caller's key, not another lookup). Every request authenticates and clients
poll status: each round trip saved is client CPU per request on PostgreSQL. On both
engines; the store's own ``read`` and ``read_batch`` are wrapped to record the
statements, nothing else is replaced."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.fixtures import both_engines

from orchestrator.db.store import Store
from orchestrator.gates.auth import authenticate

from .conftest import Api

pytestmark = both_engines


def _recording(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[tuple[str, tuple[Any, ...]]]:
    seen: list[tuple[str, tuple[Any, ...]]] = []
    real = store.engine.read

    def read(sql: str, params: Any = ()) -> Any:
        seen.append((sql, tuple(params)))
        return real(sql, tuple(params))

    monkeypatch.setattr(store.engine, "read", read)
    return seen


def _recording_batches(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[list[str]]:
    seen: list[list[str]] = []
    real = store.engine.read_batch

    def read_batch(reads: Any) -> Any:
        seen.append([sql for sql, _ in reads])
        return real(reads)

    monkeypatch.setattr(store.engine, "read_batch", read_batch)
    return seen


def test_authenticating_a_key_is_one_store_query(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording(monkeypatch, api.store)
    p = authenticate(api.store, f"Bearer {api.t.submitter}")
    assert p.account_name == "acme"
    assert len(seen) == 1, seen


def test_a_status_read_is_the_key_then_one_batch_with_no_statement_twice(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = api.run()
    store = api.client.app.state.ctx.store
    seen = _recording(monkeypatch, store)
    batches = _recording_batches(monkeypatch, store)
    r = api.client.get(f"/v1/runs/{run['run_id']}", headers=api.h(api.t.submitter))
    assert r.status_code == 200, r.json()
    assert r.json()["data"]["account"] == "acme"
    assert len(seen) == 1 and "api_keys" in seen[0][0], seen
    assert len(batches) == 1, batches
    # The run itself, its gates, proposals, progress, eval and resize events, resizes.
    assert any("FROM runs" in sql for sql in batches[0]), batches
    statements = [sql for sql, _ in seen] + batches[0]
    assert len(set(statements)) == len(statements), statements
