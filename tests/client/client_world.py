"""Fixtures and helpers of the client tests (conftest.py re-exports the fixtures).

One real ``ito-backend serve`` for the session, and per test a fresh tenant (account,
submitter and approver keys, live booking) plus a safe manifest."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.backend import Backend, start_backend
from helpers.manifests import example_manifest, write_manifest
from helpers.tenants import Tenant, booking_doc, make_tenant

from orchestrator.client.api import ItoClient
from orchestrator.client.cli import run_cli
from orchestrator.client.envelope import Envelope
from orchestrator.client.transport import ClientSettings

# Retries without waiting, so failure-path tests stay fast; every other bound as shipped.
FAST = ClientSettings(retry_backoff_s=0.0, total_timeout_s=15.0)


def fast_client(url: str, key: Any, settings: ClientSettings | None = None) -> ItoClient:
    s = (settings or ClientSettings()).model_copy(
        update={"retry_backoff_s": 0.0, "total_timeout_s": 15.0}
    )
    return ItoClient(url, key, settings=s)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("ito-backend"))
    try:
        yield b
    finally:
        b.stop()


@dataclass
class World:
    backend: Backend
    tenant: Tenant
    tmp: Path
    manifest: Path

    def train_argv(self, ref: str, key: str, *extra: str) -> list[str]:
        """The canonical `ito train` command line for this world's booking and manifest."""
        return [
            "train",
            "--booking",
            self.booking,
            "--manifest",
            str(self.manifest),
            "--confirmation-ref",
            ref,
            "--idempotency-key",
            key,
            *extra,
        ]

    @property
    def booking(self) -> str:
        return self.tenant.booking_id

    def runs_for_booking(self) -> list[tuple[str, str]]:
        """(run_id, idempotency_key) of every run of this test's booking, from the DB."""
        with sqlite3.connect(f"file:{self.backend.db}?mode=ro", uri=True) as db:
            rows = db.execute(
                "SELECT run_id, idempotency_key FROM runs WHERE booking_id = ?", (self.booking,)
            ).fetchall()
        return [(str(a), str(b)) for a, b in rows]

    def booking_row(self) -> dict[str, object]:
        """This test's booking row as the DB holds it (read-only)."""
        with sqlite3.connect(f"file:{self.backend.db}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            row = db.execute(
                "SELECT * FROM bookings WHERE booking_id = ?", (self.booking,)
            ).fetchone()
        return dict(row)

    def cli(
        self,
        monkeypatch: pytest.MonkeyPatch,
        argv: list[str],
        *,
        key: str | None = None,
        url: str | None = None,
    ) -> tuple[int, Envelope]:
        monkeypatch.setenv("ITO_API_KEY", key or self.tenant.submitter)
        monkeypatch.setenv("ITO_API_URL", url or self.backend.url)
        return run_cli(argv, client_factory=fast_client)

    def confirm_train(self, monkeypatch: pytest.MonkeyPatch) -> str:
        status, env = self.cli(
            monkeypatch,
            [
                "confirm",
                "--action",
                "train",
                "--booking",
                self.booking,
                "--manifest",
                str(self.manifest),
                "--json",
            ],
            key=self.tenant.approver,
        )
        assert status == 0, env
        ref: str = env["data"]["confirmation_ref"]
        return ref


@pytest.fixture
def world(server: Backend, tmp_path: Path) -> World:
    name = f"acct-{uuid.uuid4().hex[:10]}"
    tenant = make_tenant(server.db, name, booking=booking_doc(f"bk-{name}", name))
    manifest = write_manifest(tmp_path / "m.json", example_manifest(tmp_path / "ckpt"))
    return World(server, tenant, tmp_path, manifest)
