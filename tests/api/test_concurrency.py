"""Concurrency and crash safety against a real server process and a real SQLite file."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import Backend, start_backend
from helpers.flows import confirm_ref, submit
from helpers.manifests import example_manifest
from helpers.tenants import Tenant, make_tenant
from helpers.xdist_groups import module_group

from orchestrator.db.store import Store

pytestmark = module_group(__name__)

N = 50


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """One server for the two contention tests (each uses its own tenant)."""
    # The races under test need every request to reach the store: the per-account
    # plan bound (tests/api/test_server_abuse.py) is lifted above the server's thread
    # count, where it never bites (at the thread count a request arriving while every
    # handler works for the account is refused: a 429 in a race that must reach the store).
    b = start_backend(tmp_path_factory.mktemp("shared"), extra_args=["--plans-per-account", "64"])
    try:
        yield b
    finally:
        b.stop()


def _fire(backend: Backend, calls: list[dict[str, Any]]) -> list[httpx.Response | BaseException]:
    """Send all calls at once (one connection each), released by one barrier."""
    barrier = threading.Barrier(len(calls))

    def one(call: dict[str, Any]) -> httpx.Response | BaseException:
        with backend.client() as c:
            barrier.wait()
            try:
                return submit(c, **call)
            except httpx.HTTPError as e:
                return e

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def _runs(db: Path, account: str | None = None) -> list[dict[str, Any]]:
    store = Store(db)
    try:
        return store.read(
            "SELECT run_id, idempotency_key FROM runs JOIN accounts USING "
            "(account_id) WHERE ? IS NULL OR name = ?",
            (account, account),
        )
    finally:
        store.close()


@pytest.mark.slow
def test_50_concurrent_submits_one_key_make_one_run(shared: Backend, tmp_path: Path) -> None:
    backend, tenant = shared, make_tenant(shared.db, "one-key")
    m = example_manifest(tmp_path / "ckpt")
    with backend.client() as c:
        ref = confirm_ref(c, tenant.approver, "train", tenant.booking_id, manifest=m)
    call = {
        "submitter_key": tenant.submitter,
        "booking_id": tenant.booking_id,
        "manifest": m,
        "ref": ref,
        "idempotency_key": "one-key-for-all",
    }
    answers = _fire(backend, [call] * N)
    assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers), [
        a.json() if isinstance(a, httpx.Response) else repr(a) for a in answers
    ]
    run_ids = {a.json()["data"]["run_id"] for a in answers if isinstance(a, httpx.Response)}
    assert len(run_ids) == 1
    replayed = [a.json()["data"]["replayed"] for a in answers if isinstance(a, httpx.Response)]
    assert replayed.count(False) == 1
    assert [r["run_id"] for r in _runs(backend.db, tenant.account)] == list(run_ids)


@pytest.mark.slow
def test_50_keys_one_confirmation_make_one_run(shared: Backend, tmp_path: Path) -> None:
    backend, tenant = shared, make_tenant(shared.db, "one-confirmation")
    m = example_manifest(tmp_path / "ckpt")
    with backend.client() as c:
        ref = confirm_ref(c, tenant.approver, "train", tenant.booking_id, manifest=m)
    calls: list[dict[str, Any]] = [
        {
            "submitter_key": tenant.submitter,
            "booking_id": tenant.booking_id,
            "manifest": m,
            "ref": ref,
            "idempotency_key": f"key-{i:04d}",
        }
        for i in range(N)
    ]
    answers = [a for a in _fire(backend, calls) if isinstance(a, httpx.Response)]
    assert len(answers) == N
    ok = [a for a in answers if a.status_code == 200]
    refused = [a.json()["error"]["code"] for a in answers if a.status_code != 200]
    assert len(ok) == 1 and refused == ["confirmation_consumed"] * (N - 1)
    assert len(_runs(backend.db, tenant.account)) == 1


@pytest.mark.slow
def test_sigkill_during_submits_loses_no_acknowledged_run(tmp_path: Path) -> None:
    # Durability under concurrent submits of one account: its plan bound is lifted
    # above the server's thread count (as for the races above).
    backend = start_backend(tmp_path / "backend", extra_args=["--plans-per-account", "64"])
    try:
        _sigkill_during_submits(backend, make_tenant(backend.db, "acme"), tmp_path)
    finally:
        backend.stop()


def _sigkill_during_submits(backend: Backend, tenant: Tenant, tmp_path: Path) -> None:
    m = example_manifest(tmp_path / "ckpt")
    with backend.client() as c:
        refs = [
            confirm_ref(c, tenant.approver, "train", tenant.booking_id, manifest=m)
            for _ in range(N)
        ]
    calls: list[dict[str, Any]] = [
        {
            "submitter_key": tenant.submitter,
            "booking_id": tenant.booking_id,
            "manifest": m,
            "ref": ref,
            "idempotency_key": f"crash-{i:04d}",
        }
        for i, ref in enumerate(refs)
    ]
    acked: dict[str, str] = {}
    in_flight: list[str] = []  # sent, and the connection died before an answer
    lock = threading.Lock()
    killed = threading.Event()
    assert backend.proc is not None

    def one(call: dict[str, Any]) -> None:
        try:
            with backend.client() as c:
                r = submit(c, **call)
        except httpx.ConnectError:
            return  # sent after the kill: never reached the server
        except httpx.HTTPError:
            with lock:  # in flight when the server died: not acknowledged
                in_flight.append(call["idempotency_key"])
            return
        if r.status_code == 200:
            with lock:
                acked[call["idempotency_key"]] = r.json()["data"]["run_id"]
                # SIGKILL once some submits were acknowledged and others are in flight.
                if len(acked) == N // 5 and not killed.is_set():
                    killed.set()
                    backend.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]

    with ThreadPoolExecutor(N) as pool:
        list(pool.map(one, calls))
    assert killed.is_set() and len(acked) >= N // 5
    # The kill met requests on the wire: fewer were acknowledged than sent.
    assert in_flight and len(acked) < N, (len(acked), in_flight)
    backend.proc.wait(10)
    backend.restart()

    runs = _runs(backend.db)
    by_key: dict[str, list[str]] = {}
    for row in runs:
        by_key.setdefault(row["idempotency_key"], []).append(row["run_id"])
    assert all(len(v) == 1 for v in by_key.values()), "a key maps to two runs"
    for key, run_id in acked.items():
        assert by_key.get(key) == [run_id], f"acknowledged run {run_id} lost"
    # Retrying everything after the restart (same key, same body) creates no duplicate:
    # committed ones replay, the rest are created once.
    with backend.client() as client:
        for call in calls:
            r = submit(client, **call)
            assert r.status_code == 200, r.json()
            if call["idempotency_key"] in acked:
                assert r.json()["data"] == {
                    **r.json()["data"],
                    "run_id": acked[call["idempotency_key"]],
                    "replayed": True,
                }
    keys = [row["idempotency_key"] for row in _runs(backend.db)]
    assert sorted(keys) == sorted(call["idempotency_key"] for call in calls)
