"""A store outage under the supervisor's loop: it keeps running, says so once when the
outage starts and once when it ends, not a traceback every turn. The store is a stand-in
(the outage itself, on a real PostgreSQL, is tests/api/test_store_outage.py)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.runtime.ray_cluster import RaySettings
from orchestrator.runtime.supervisor import RayRuntime
from orchestrator.runtime.supervisor_settings import SupervisorSettings
from stages.errors import ErrorCode, ItoError

OUTAGE_TURNS = 6


class _BlinkingStore:
    """Refuses every call for the first ``OUTAGE_TURNS`` lease attempts, then leads."""

    def __init__(self) -> None:
        self.attempts = 0
        self.served = threading.Event()

    def fenced(self, fence: Any) -> _BlinkingStore:
        return self

    def acquire_lease(self, fence: Any, lease_s: float) -> int:
        self.attempts += 1
        if self.attempts <= OUTAGE_TURNS:
            raise ItoError(ErrorCode.store_unavailable, "the store did not answer")
        return 1

    def runs_in_states(self, states: Any) -> list[Any]:
        self.served.set()
        return []

    def release_lease(self, fence: Any) -> None:
        pass


def test_an_outage_is_logged_when_it_starts_and_ends_and_the_loop_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _BlinkingStore()
    runtime = RayRuntime(
        store,  # type: ignore[arg-type]
        tmp_path,
        RaySettings(),
        SupervisorSettings(poll_interval_s=0.01, supervisor_lease_s=1.0),
    )
    runtime._authority_checked_at = float("inf")  # no authority pass: nothing to check
    with caplog.at_level(logging.WARNING, logger="orchestrator.runtime.supervisor"):
        thread = threading.Thread(target=runtime._loop, daemon=True)
        thread.start()
        assert store.served.wait(30), "the loop did not lead once the store answered"
        runtime._stop.set()
        runtime._wake.set()
        thread.join(10)
    assert store.attempts > OUTAGE_TURNS
    lines = [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info], "a traceback for an outage"
    assert sum("waits for the store" in m for m in lines) == 1, lines
    assert sum("answers again" in m for m in lines) == 1, lines
