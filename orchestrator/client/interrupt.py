"""Ctrl-C for the ``ito`` process: a request to stop at the next safe point.

A ``KeyboardInterrupt`` raised inside the client's event loop can leave httpx's
connection pool mid-request, and the close that follows may then wait forever (the
process hangs instead of exiting 130). So the first SIGINT only marks the stop; the
client's waits (the poll interval of ``--follow``, retry backoff) see it and raise
``KeyboardInterrupt`` there, with no request in flight. A request already sent runs
to its answer or its timeout: it may have changed state (a submit), and its answer is
what the user needs to see. A second SIGINT raises at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class StopRequest:
    def __init__(self) -> None:
        self._requested = threading.Event()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def on_sigint(self, _signum: int, _frame: FrameType | None) -> None:
        if self._requested.is_set():
            raise KeyboardInterrupt
        self._requested.set()

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that ends, raising ``KeyboardInterrupt``, once a stop is asked."""
        if self._requested.wait(max(0.0, seconds)):
            raise KeyboardInterrupt


@contextmanager
def stop_on_sigint() -> Iterator[StopRequest]:
    """Route SIGINT to a ``StopRequest`` for the block (main thread only)."""
    stop = StopRequest()
    previous = signal.signal(signal.SIGINT, stop.on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
