"""A real ``ito-backend serve`` under hostile requests: bounded validation,
nothing secret in the access log, a SIGTERM that ends the server in bounded time."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import signal
import threading
from typing import Any

import httpx
import pytest
from helpers.backend import Backend
from helpers.manifests import example_manifest
from helpers.tenants import Tenant
from helpers.waiting import wait_until

HUGE = 640000000000000000000000000000  # 6.4e29 tokens a batch
# Generous deadlines on each request (never a timing assertion): the old code never
# answered these at all.
REQUEST_DEADLINE_S = 10.0


def _plan_body(t: Tenant, m: dict[str, Any]) -> dict[str, str]:
    raw = json.dumps(m).encode()
    return {
        "booking_id": t.booking_id,
        "manifest_b64": base64.b64encode(raw).decode(),
        "manifest_digest": hashlib.sha256(raw).hexdigest(),
    }


@pytest.mark.slow
def test_huge_batch_is_refused_while_others_are_served(
    backend: Backend, tenant: Tenant, tmp_path: Any
) -> None:
    m = example_manifest(tmp_path / "ckpt")
    m["training"]["global_batch_tokens"] = HUGE
    h = {"Authorization": f"Bearer {tenant.submitter}"}
    answers: list[int] = []
    errors: list[BaseException] = []

    def hostile() -> None:
        try:
            r = httpx.post(
                backend.url + "/v1/plans",
                json=_plan_body(tenant, m),
                headers=h,
                timeout=REQUEST_DEADLINE_S,
            )
            answers.append(r.status_code)
            # Refused by the model, or before any work by the account's plan bound.
            assert (r.status_code, r.json()["error"]["code"]) in (
                (422, "manifest_invalid"),
                (429, "too_many_concurrent_plans"),
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=hostile) for _ in range(8)]
    for th in threads:
        th.start()
    # Others keep being served meanwhile (the old code pinned every request thread).
    for _ in range(5):
        r = httpx.get(
            f"{backend.url}/v1/bookings/{tenant.booking_id}/eligibility",
            headers=h,
            timeout=REQUEST_DEADLINE_S,
        )
        assert r.status_code == 200
    for th in threads:
        th.join(REQUEST_DEADLINE_S * 2)
    assert not errors, errors
    assert len(answers) == 8 and 422 in answers, answers


@pytest.mark.slow
def test_canary_ids_never_reach_the_access_log(backend: Backend, tenant: Tenant) -> None:
    h = {"Authorization": f"Bearer {tenant.submitter}"}
    canary_key = "canary-idem-7f3a9c2e"
    canary_run = "canary-run-5d1e8b4a"
    with httpx.Client(base_url=backend.url, headers=h, timeout=REQUEST_DEADLINE_S) as c:
        c.get("/v1/runs", params={"idempotency_key": canary_key})
        c.get(f"/v1/runs/{canary_run}")
        c.get(f"/v1/runs/{canary_run}/logs", params={"cursor": "0"})
        assert c.get("/healthz").status_code == 200

    def flushed() -> str:
        text = backend.log_text()
        return text if "/v1/runs/{id}/logs" in text else ""

    # The access log is on, redacted (waits for the server to flush it).
    log = wait_until(flushed, REQUEST_DEADLINE_S, "the access log line of the last request")
    assert '"GET /v1/runs/{id} HTTP/1.1" 404' in log
    assert "/v1/runs?{query}" in log
    assert canary_key not in log and canary_run not in log


@pytest.mark.slow
def test_sigterm_stops_the_server_within_its_grace(backend: Backend, tenant: Tenant) -> None:
    h = {"Authorization": f"Bearer {tenant.submitter}"}
    stop = threading.Event()
    served: list[int] = []

    def load() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                served.append(
                    httpx.get(
                        f"{backend.url}/v1/bookings/{tenant.booking_id}/eligibility",
                        headers=h,
                        timeout=2.0,
                    ).status_code
                )

    workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        # SIGTERM lands while every load thread is sending (each was answered once).
        wait_until(
            lambda: len(served) >= 2 * len(workers),
            REQUEST_DEADLINE_S * 3,
            "the load threads' first answers",
        )
        assert set(served) == {200}
        assert backend.proc is not None
        backend.proc.send_signal(signal.SIGTERM)
        # serve's default grace is 10 s; 40 s is a generous bound, not a speed claim.
        # uvicorn re-raises the SIGTERM once its graceful shutdown is done (not a kill).
        assert backend.proc.wait(timeout=40) == -signal.SIGTERM
    finally:
        stop.set()
