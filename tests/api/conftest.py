"""Fixtures of the API tests: an in-process app (real SQLite, real gates) and helpers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from helpers import flows
from helpers.fixtures import backend, tenant  # noqa: F401  (re-exported fixtures)
from helpers.manifests import example_manifest
from helpers.tenants import Tenant, make_tenant

from orchestrator.api import create_app
from orchestrator.db.store import Store
from orchestrator.settings import Settings


@dataclass
class Api:
    client: TestClient
    db: str
    tmp: Path
    t: Tenant
    store: Store

    def h(self, key: str, idem: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {key}"}
        if idem is not None:
            headers["Idempotency-Key"] = idem
        return headers

    def manifest(self, **sections: Any) -> dict[str, Any]:
        return example_manifest(self.tmp / "ckpt", **sections)

    def confirm(
        self,
        action: str = "train",
        manifest: Any = None,
        key: str | None = None,
        booking_id: str | None = None,
        cost_usd: float = 100.0,
        **extra: Any,
    ) -> dict[str, Any]:
        if action == "train" and manifest is None:
            manifest = self.manifest()
        return flows.confirm(
            self.client,
            key or self.t.approver,
            action,
            booking_id or self.t.booking_id,
            cost_usd=cost_usd,
            manifest=manifest if action == "train" else None,
            **extra,
        )

    def ref(self, action: str = "train", **kw: Any) -> str:
        env = self.confirm(action, **kw)
        assert env["ok"], env
        ref: str = env["data"]["confirmation_ref"]
        return ref

    def submit(
        self,
        manifest: Any = None,
        ref: str | None = None,
        idem: str = "key-0000001",
        key: str | None = None,
        booking_id: str | None = None,
    ) -> Any:
        m = manifest if manifest is not None else self.manifest()
        bid = booking_id or self.t.booking_id
        if ref is None:
            ref = self.ref(manifest=m, booking_id=bid)
        return flows.submit(self.client, key or self.t.submitter, bid, m, ref, idem)

    def run(self, **kw: Any) -> dict[str, Any]:
        r = self.submit(**kw)
        assert r.status_code == 200, r.json()
        data: dict[str, Any] = r.json()["data"]
        return data


@pytest.fixture
def api(tmp_path: Path, db: str) -> Iterator[Api]:
    """The app on a fresh store: SQLite, or PostgreSQL too where a module runs
    ``both_engines``."""
    # These tests isolate the other gates; the planner gate (on by default) has its own
    # tests in test_planning.py, since llama-tiny on 8 H100s is wasteful to it.
    settings = Settings(db_path=db, var_dir=tmp_path / "var", planner_gate=False)
    store = Store(db)
    t = make_tenant(db, "acme")
    with TestClient(create_app(settings)) as client:
        yield Api(client, db, tmp_path, t, store)
    store.close()


def code_of(resp: Any) -> str:
    body = resp.json()
    assert body["ok"] is False and body["live_api_contacted"] is True, body
    code: str = body["error"]["code"]
    return code
