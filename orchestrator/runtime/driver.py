"""RunDriver: one detached, named Ray actor per run (``ito/run-<run_id>``).

It runs the run's pipeline of stages in a thread and buffers what they emit as
numbered events. It never writes the store: the API server's supervisor pulls
events with ``poll(after_seq)``, persists them, and by asking for events after
``after_seq`` acknowledges everything up to it, so nothing is dropped before it is
durable. A restarted API server reattaches by name and continues from the last
sequence number it persisted.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypedDict

from orchestrator.runtime import launch
from orchestrator.runtime.factories import StageFactory, StartEarly
from orchestrator.runtime.launch import LaunchSpec
from orchestrator.runtime.ray_cluster import PRIVATE_UMASK
from stages.base import GateOutcome, PrestartableStage, StageContext
from stages.errors import ErrorCode, ItoError
from stages.event_buffer import EventBuffer, as_int
from stages.events import (
    Event,
    EventPayload,
    LogEvent,
    PhaseEvent,
    StageResultEvent,
    StepEvent,
)
from stages.resize import ResizeRequest
from stages.trainer.fleet.handoff import Fleet

DriverState = Literal["created", "running", "succeeded", "failed", "cancelled"]


class DriverPoll(TypedDict):
    """A driver's answer to the supervisor's poll: the events after its last seq and
    where the run stands."""

    events: list[EventPayload]  # each with its ``seq``
    state: DriverState
    error_code: str | None
    reason: str
    more: bool  # events left beyond ``limit``
    pid: int


class DriverPing(TypedDict):
    run_id: str
    state: DriverState
    attempt: int
    pid: int


# Events a driver keeps unacknowledged before it aggregates them (stages.event_buffer).
MAX_BUFFERED_EVENTS = 50_000
POLL_BATCH_LIMIT = 2_000


class _RayGauges:
    """Run metrics mirrored into Ray's own metrics (Ray dashboard / Ray's exporter)."""

    def __init__(self, run_id: str, booking_id: str):
        from ray.util import metrics

        tags = ("run_id", "booking_id")
        self._tags = {"run_id": run_id, "booking_id": booking_id}
        self.step = metrics.Gauge("ito_driver_step", "Last committed step", tag_keys=tags)
        self.loss = metrics.Gauge("ito_driver_loss", "Last committed loss", tag_keys=tags)
        self.tokens_per_s = metrics.Gauge(
            "ito_driver_tokens_per_second", "Tokens/s of the last committed step", tag_keys=tags
        )
        self.quorum = metrics.Gauge(
            "ito_driver_quorum_size", "Replica groups in the quorum", tag_keys=tags
        )

    def on_step(self, ev: StepEvent) -> None:
        self.step.set(ev.step, tags=self._tags)
        self.loss.set(ev.loss, tags=self._tags)
        self.quorum.set(ev.quorum_size, tags=self._tags)
        if ev.seconds > 0:
            self.tokens_per_s.set(ev.tokens / ev.seconds, tags=self._tags)


class RunDriverImpl:
    """The actor's body; plain Python so it is testable without Ray."""

    def __init__(
        self,
        spec: dict[str, object],  # a LaunchSpec as its model_dump, validated here
        *,
        use_ray_metrics: bool = True,
        pipeline: Callable[[LaunchSpec], list[tuple[str, StageFactory]]] | None = None,
    ):
        self.spec = LaunchSpec.model_validate(spec)
        self._pipeline = pipeline
        launch.verify(self.spec)  # a driver not launched by the API refuses to exist
        self._lock = threading.Lock()
        self._events = EventBuffer(MAX_BUFFERED_EVENTS)
        self._next_seq = self.spec.seq_start
        self.state: DriverState = "created"
        self.error_code: str | None = None
        self.reason = ""
        workdir = Path(self.spec.workdir)
        # Run scratch holds cleaned tenant data: private to the backend's user.
        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        workdir.chmod(0o700)
        self.ctx = StageContext(
            run_id=self.spec.run_id,
            booking_id=self.spec.booking_id,
            workdir=workdir,
            emit=self._emit,
            # Their account is the signed spec's: checkpoints are sealed for it.
            facts=self.spec.facts,
            # One trainer fleet for the run: pretraining's ranks go on to post-training.
            fleet=Fleet(workdir / "fleet"),
        )
        self._gauges = (
            _RayGauges(self.spec.run_id, self.spec.booking_id) if use_ray_metrics else None
        )
        self._thread: threading.Thread | None = None
        # Stages made and prestarted ahead of their turn (``StartEarly``), by name.
        self._early: dict[str, PrestartableStage] = {}

    # -- event buffer -------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        if self._gauges is not None and isinstance(event, StepEvent) and event.committed:
            self._gauges.on_step(event)
        with self._lock:
            payload = event.model_dump(mode="json")
            payload["seq"] = self._next_seq
            self._next_seq += 1
            self._events.append(payload)  # beyond the bound: aggregated, never dropped

    def poll(self, after_seq: int, limit: int = POLL_BATCH_LIMIT) -> DriverPoll:
        """Events with seq > after_seq (those <= after_seq are acknowledged and dropped)."""
        with self._lock:
            items = self._events.items
            while items and as_int(items[0]["seq"]) <= after_seq:
                items.popleft()
            batch = [e for _, e in zip(range(limit), items, strict=False)]
            return {
                "events": batch,
                "state": self.state,
                "error_code": self.error_code,
                "reason": self.reason,
                "more": len(items) > len(batch),
                "pid": os.getpid(),
            }

    # -- control ------------------------------------------------------------------------
    def start(self) -> str:
        if self._thread is None:
            self.state = "running"
            if self.spec.attempt == 1:
                # From acceptance to the driver running: queueing and Ray start-up.
                self._emit(
                    PhaseEvent(phase="startup", start=self.spec.accepted_at, end=time.time())
                )
            self._thread = threading.Thread(target=self._run, name="pipeline", daemon=True)
            self._thread.start()
        return self.state

    def cancel(self) -> None:
        self.ctx.cancel_event.set()
        with self.ctx._decided:
            self.ctx._decided.notify_all()

    def decide(self, proposal_id: str, decision: Literal["approved", "declined"]) -> None:
        self.ctx.decide(proposal_id, decision)

    def resize(self, request: dict[str, object]) -> None:
        """The booking's size changed: the trainer takes the request at a step boundary
        (a newer one replaces one not yet taken)."""
        self.ctx.resize_inbox.put(ResizeRequest.model_validate(request))

    def ping(self) -> DriverPing:
        return {
            "run_id": self.spec.run_id,
            "state": self.state,
            "attempt": self.spec.attempt,
            "pid": os.getpid(),
        }

    # -- the pipeline -------------------------------------------------------------------
    def _run(self) -> None:
        ctx = self.ctx
        try:
            if self._pipeline is None:
                from orchestrator.runtime.pipeline import build_pipeline

                self._pipeline = build_pipeline
            pipeline = self._pipeline(self.spec)
            for name, make_stage in pipeline:
                done = self.spec.completed_stages.get(name)
                if done is not None:
                    ctx.previous[name] = GateOutcome.model_validate(done)
                    ctx.log(
                        f"stage {name}: already {done['status']} in an earlier attempt", stage=name
                    )
                    self._start_early(name, pipeline)
                    continue
                if ctx.cancelled:
                    break
                outcome = self._run_stage(name, make_stage)
                ctx.previous[name] = outcome
                if outcome.passed:
                    self._start_early(name, pipeline)
                self._emit(StageResultEvent(stage=name, outcome=outcome.model_dump(mode="json")))
                if not outcome.passed:
                    self.error_code = outcome.error_code or ErrorCode.gate_failed
                    self.reason = f"stage {name} {outcome.status}: {outcome.reason}"
                    break
            if ctx.cancelled:
                self.state = "cancelled"
                self.reason = "cancelled on request"
            elif self.error_code is not None:
                self.state = "failed"
            else:
                self.state = "succeeded"
        except Exception as e:  # the driver must report, never die silently
            self.error_code = ErrorCode.internal_error
            self.reason = f"driver error: {type(e).__name__}"
            self._emit(LogEvent(level="error", message=traceback.format_exc(limit=8)))
            self.state = "failed"
        finally:
            self._abandon_early()
            ctx.fleet.shutdown()  # the ranks the last engine run left
        self._emit(
            LogEvent(message=f"run {self.state}" + (f": {self.reason}" if self.reason else ""))
        )

    def _start_early(self, passed: str, pipeline: list[tuple[str, StageFactory]]) -> None:
        """Make and prestart the later stages that wait only for stage ``passed``."""
        for name, make in pipeline:
            if (
                not isinstance(make, StartEarly)
                or make.after != passed
                or name in self.spec.completed_stages
                or name in self._early
            ):
                continue
            try:
                stage = make(self.ctx)
                if not isinstance(stage, PrestartableStage):
                    continue
                stage.prestart(self.ctx)
            except Exception:  # its own turn makes it again and reports the error
                self.ctx.emit(
                    LogEvent(level="warning", stage=name, message=traceback.format_exc(limit=4))
                )
                continue
            self._early[name] = stage
            self.ctx.log(f"stage {name}: prestarted while earlier stages run", stage=name)

    def _abandon_early(self) -> None:
        """Stages prestarted but never run (a failed gate, a cancel) release what they
        hold: the warm trainer fleet is torn down."""
        for name, stage in self._early.items():
            if name in self.ctx.previous:
                continue
            try:
                stage.abandon()
            except Exception:
                self.ctx.emit(
                    LogEvent(level="error", stage=name, message=traceback.format_exc(limit=4))
                )

    def _run_stage(self, name: str, make_stage: StageFactory) -> GateOutcome:
        ctx = self.ctx
        t0 = time.time()
        ctx.log(f"stage {name}: started", stage=name)
        try:
            stage = self._early.get(name) or make_stage(ctx)
            outcome: GateOutcome = stage.run(ctx)
        except ItoError as e:
            outcome = GateOutcome(
                stage=name, status="failed", reason=e.message, error_code=str(e.code)
            )
        except Exception as e:
            ctx.emit(LogEvent(level="error", stage=name, message=traceback.format_exc(limit=8)))
            outcome = GateOutcome(
                stage=name,
                status="failed",
                error_code=ErrorCode.stage_failed,
                reason=f"{type(e).__name__}: {str(e)[:300]}",
            )
        if name != "train":
            # A stage's time outside its steps and finer spans (data prep before the
            # first step; fleet starts and hand-overs in post-training) is start-up.
            ctx.emit(PhaseEvent(stage=name, phase="startup", start=t0, end=time.time()))
        ctx.log(
            f"stage {name}: {outcome.status} ({time.time() - t0:.1f}s) {outcome.reason}", stage=name
        )
        return outcome


def driver_actor_class() -> Any:
    """The Ray actor class, made on demand so importing this module needs no Ray."""
    import ray

    class RunDriver(RunDriverImpl):  # the name SREs see in the Ray dashboard
        def __init__(self, spec: dict[str, object]):
            # The driver's process is its own: what it writes is private to the
            # backend's user even on a cluster whose raylets run with a wider umask.
            os.umask(PRIVATE_UMASK)
            super().__init__(spec)

    return ray.remote(RunDriver)
