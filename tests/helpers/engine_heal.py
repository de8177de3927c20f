"""The kill-and-heal sequence the learner-engine tests share: a ``TrainingEngine`` of
two replica groups runs in a background thread with its events collected; group 1 is
SIGKILLed after a few steps in the full quorum; the survivor must commit alone, Ray
restarts the lost group, which heals from its live peer and rejoins; the run ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.events import Event, InterruptionEvent, LogEvent, StepEvent

# Hang guards, never speed claims.
EVENT_TIMEOUT_S = 240.0
FINISH_TIMEOUT_S = 300.0
CANCEL_JOIN_TIMEOUT_S = 60.0
STEPS_BEFORE_KILL = 5

EngineFactory = Callable[[Callable[[Event], None], threading.Event], Any]


@dataclass
class HealedRun:
    result: Any  # the engine's EngineResult
    events: list[Event]
    recovered: InterruptionEvent


def events_summary(events: list[Event]) -> str:
    """The run's log lines, interruptions and last steps (for assertion messages)."""
    lines = [
        f"{e.ts:.1f} {e.message}" if isinstance(e, LogEvent) else f"{e.ts:.1f} {e!r}"
        for e in events
        if isinstance(e, LogEvent | InterruptionEvent)
    ]
    steps = [e for e in events if isinstance(e, StepEvent)][-4:]
    return "\n".join(lines[-40:] + [repr(e) for e in steps])[-5000:]


def kill_one_group_and_heal(make_engine: EngineFactory, run_id: str) -> HealedRun:
    """Run ``make_engine(emit, cancel)`` to its end through the kill of group 1."""
    from stages.trainer import kill_replica_group

    events: list[Event] = []
    cond = threading.Condition()

    def emit(e: Event) -> None:
        with cond:
            events.append(e)
            cond.notify_all()

    def wait_for(pred: Callable[[Any], bool], what: str) -> Any:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        with cond:
            while True:
                hit = next((e for e in events if pred(e)), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for {what}: {events_summary(events)}"
                cond.wait(min(left, 1.0))

    cancel = threading.Event()
    engine = make_engine(emit, cancel)
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(r=engine.run()), daemon=True)
    thread.start()
    try:
        wait_for(
            lambda e: (
                isinstance(e, StepEvent)
                and e.committed
                and e.step >= STEPS_BEFORE_KILL
                and e.quorum_size == 2
            ),
            f"{STEPS_BEFORE_KILL} steps in the full quorum",
        )
        killed_at, pids = kill_replica_group(run_id, 1)
        assert pids
        wait_for(
            lambda e: (
                isinstance(e, StepEvent)
                and e.replica_group == 0
                and e.committed
                and e.quorum_size == 1
                and e.ts > killed_at
            ),
            "the survivor commits alone",
        )
        recovered = wait_for(
            lambda e: (
                isinstance(e, InterruptionEvent)
                and e.interruption_kind == "replica_group_lost"
                and e.recovered_at is not None
            ),
            "group 1 recovered",
        )
        assert recovered.replica_group == 1
        thread.join(timeout=FINISH_TIMEOUT_S)
    finally:
        cancel.set()
        thread.join(timeout=CANCEL_JOIN_TIMEOUT_S)
    assert "r" in box, f"the run did not end: {events_summary(events)}"
    rejoined = [
        e
        for e in events
        if isinstance(e, StepEvent)
        and e.replica_group == 1
        and e.committed
        and e.quorum_size == 2
        and e.ts > recovered.recovered_at
    ]
    assert rejoined, "group 1 never rejoined the full quorum"
    return HealedRun(box["r"], events, recovered)
