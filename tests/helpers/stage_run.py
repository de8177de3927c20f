"""A training stage's ``run()`` in a background thread, with its events collected, so a
test can wait on an event (never a sleep), kill things mid-run, then read the outcome."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.base import GateOutcome, StageContext
from stages.events import Event, LogEvent, StepEvent

# Waiting for the thread after a cancel (a failed assertion must not leave the engine
# running into Ray's shutdown).
CANCEL_JOIN_TIMEOUT_S = 60.0


def _ray_state() -> str:
    """What Ray had free and which named actors lived (for a timeout's message)."""
    import ray

    if not ray.is_initialized():
        return "ray is not initialised"
    actors = sorted(a for a in ray.util.list_named_actors())
    return f"ray free: {ray.available_resources()}\nnamed actors: {actors}"


class StageRun:
    def __init__(
        self, cfg: Any, workdir: Path, run_id: str, *, wait_s: float, join_timeout_s: float
    ):
        from stages.trainer import TrainingStage

        self.wait_s, self.join_timeout_s = wait_s, join_timeout_s
        self.events: list[Event] = []
        self.cond = threading.Condition()
        workdir.mkdir(parents=True, exist_ok=True)
        self.ctx = StageContext(run_id=run_id, booking_id="bk", workdir=workdir, emit=self._emit)
        self.outcome: GateOutcome | None = None
        self.ended = False
        self.thread = threading.Thread(target=self._run, args=(TrainingStage(cfg),), daemon=True)
        self.thread.start()

    def __enter__(self) -> StageRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctx.cancel_event.set()
        self.thread.join(timeout=CANCEL_JOIN_TIMEOUT_S)

    def _emit(self, e: Event) -> None:
        with self.cond:
            self.events.append(e)
            self.cond.notify_all()

    def _run(self, stage: Any) -> None:
        try:
            self.outcome = stage.run(self.ctx)
        finally:
            with self.cond:
                self.ended = True
                self.cond.notify_all()

    def wait_for(self, pred: Callable[[Any], bool], what: str) -> Any:
        """The first event (so far or to come) for which ``pred`` holds; fails at once
        once the run has ended without one (every event it emits is in by then)."""
        deadline = time.monotonic() + self.wait_s
        with self.cond:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                assert not self.ended, (
                    f"the run ended ({self.outcome}) before {what}\n{self.logs()}"
                )
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for {what}\n{self.logs()}\n{_ray_state()}"
                self.cond.wait(min(left, 1.0))

    def logs(self) -> str:
        """The run's latest log lines (for assertion messages)."""
        return (
            "last logs:\n"
            + "\n".join(
                f"{e.ts:.2f} {e.message}" for e in self.events[-400:] if isinstance(e, LogEvent)
            )[-3000:]
        )

    def join(self) -> GateOutcome:
        self.thread.join(timeout=self.join_timeout_s)
        assert self.outcome is not None
        return self.outcome

    def steps(self, group: int | None = None) -> list[StepEvent]:
        return [
            e
            for e in self.events
            if isinstance(e, StepEvent) and (group is None or e.replica_group == group)
        ]

    def kill_group(self, group: int, *, survivor: int = 0) -> float:
        """SIGKILL replica group ``group``'s ranks (a real process kill) and wait until
        group ``survivor`` committed a step alone after it (torchft dropped the lost
        group from its quorum); returns when the kill was sent."""
        from stages.trainer import kill_replica_group

        killed_at, pids = kill_replica_group(self.ctx.run_id, group)
        assert pids, f"group {group} had no live rank to kill"
        self.wait_for(
            lambda e: (
                isinstance(e, StepEvent)
                and e.replica_group == survivor
                and e.committed
                and e.quorum_size == 1
                and e.ts > killed_at
            ),
            f"group {survivor} committing alone after group {group}'s kill",
        )
        return float(killed_at)
