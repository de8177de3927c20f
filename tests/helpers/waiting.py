"""Waiting on a condition with a generous deadline: tests synchronise on events, never
on a sleep, and a deadline is a hang guard, not a speed claim."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """Call ``cond`` until it returns something truthy, and return that; fail with
    ``what`` once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(poll_s)
