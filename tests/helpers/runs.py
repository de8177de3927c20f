"""Reading a run through the API as a client does, and waiting on its state: every
end-to-end test polls the same way, and a run that ends otherwise fails the wait at
once with its last log lines and the server's log."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from helpers.backend import Backend

FINAL_STATES = frozenset({"failed", "cancelled", "succeeded", "cleaned"})
RUN_POLL_S = 0.3


def api_data(backend: Backend, api_key: str, path: str) -> dict[str, Any]:
    """The ``data`` of a successful GET envelope."""
    with backend.client(api_key) as c:
        body: dict[str, Any] = c.get(path).json()
    assert body["ok"], body
    data: dict[str, Any] = body["data"]
    return data


def run_tail(backend: Backend, run_id: str, lines: int = 40) -> str:
    """The run's last log lines (from the store) and the server's log, for a failure."""
    text = ""
    if not str(backend.db).startswith("postgresql://"):
        from orchestrator.db.store import Store

        store = Store(backend.db)
        try:
            logs = store.list_logs(run_id, 0, 1000)
        finally:
            store.close()
        text = "\n".join(f"{e['stage']}: {e['message']}" for e in logs[-lines:])
    return f"{text}\n{backend.log_text()[-3000:]}"


def wait_run(
    backend: Backend,
    api_key: str,
    run_id: str,
    pred: Callable[[dict[str, Any]], bool],
    what: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Poll ``GET /v1/runs/{run_id}`` until ``pred(run)``; fail if the run reaches a
    final state that does not satisfy it, or after ``timeout_s`` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            run = api_data(backend, api_key, f"/v1/runs/{run_id}")
        except httpx.HTTPError:  # the server restarting under the test
            time.sleep(RUN_POLL_S)
            continue
        if pred(run):
            return run
        if run["state"] in FINAL_STATES:
            break
        time.sleep(RUN_POLL_S)
    raise AssertionError(
        f"run {run_id} never reached {what}; last {run}\n{run_tail(backend, run_id)}"
    )


def wait_final(backend: Backend, api_key: str, run_id: str, timeout_s: float) -> dict[str, Any]:
    """The run once it is in a final state."""
    return wait_run(
        backend, api_key, run_id, lambda r: r["state"] in FINAL_STATES, "a final state", timeout_s
    )
