"""The one small protocol through which the orchestrator knows a stage.

A stage has a name, a pydantic config model, and ``run(ctx) -> GateOutcome``. It is
testable alone: build a ``StageContext`` with a temp workdir and a list-appending
``emit`` and call ``run``. Stages never import the orchestrator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from stages.events import Event, LogEvent
from stages.resize import ResizeInbox
from stages.run_facts import RunFacts
from stages.run_secret import RunSecret

GateStatus = Literal["passed", "failed", "no_decision", "skipped"]


class StrictModel(BaseModel):
    """Base of every config that crosses a boundary: strict types, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class GateOutcome(BaseModel):
    """What a stage reports: did its gate pass, with the numbers and the reason."""

    model_config = ConfigDict(extra="forbid")
    stage: str
    status: GateStatus
    reason: str
    metrics: dict[str, float] = Field(default_factory=dict)
    # Structured, secret-free results later stages may use (paths, plan, decision).
    artifacts: dict[str, Any] = Field(default_factory=dict)
    error_code: str | None = None

    @property
    def passed(self) -> bool:
        return self.status in ("passed", "no_decision", "skipped")


@dataclass
class StageContext:
    run_id: str
    booking_id: str
    workdir: Path
    emit: Callable[[Event], None] = field(default=lambda _e: None)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    # Outcomes of the stages that already ran, by stage name.
    previous: dict[str, GateOutcome] = field(default_factory=dict)
    # Run-scoped facts the orchestrator resolved (booking topology, placement,
    # account, input roots, ...), one typed field each.
    facts: RunFacts = field(default_factory=RunFacts)
    # The run's trainer ranks, handed from one engine run to the next across stages
    # (pretraining's fleet trains post-training's objectives): a
    # ``stages.trainer.fleet.handoff.Fleet`` the orchestrator makes and ends; None: each
    # stage keeps its own.
    fleet: Any = None
    # The run's secret, proven by the run's processes on every listener they open
    # (stages.netsec). Made with the context, so a relaunched driver's run has a new one.
    secret: RunSecret = field(default_factory=RunSecret.new)
    # The booking's size changes (``stages.resize``), put by the orchestrator, taken by
    # the trainer at a step boundary.
    resize_inbox: ResizeInbox = field(default_factory=ResizeInbox)

    # Human decisions on proposals (``ProposalEvent``), filled by the orchestrator.
    _decisions: dict[str, str] = field(default_factory=dict)
    _decided: threading.Condition = field(default_factory=threading.Condition)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def decide(self, proposal_id: str, decision: Literal["approved", "declined"]) -> None:
        """Called by the orchestrator when a human approved or declined a proposal."""
        with self._decided:
            self._decisions[proposal_id] = decision
            self._decided.notify_all()

    def wait_decision(self, proposal_id: str, timeout_s: float) -> str | None:
        """Block until a decision on ``proposal_id`` arrives, the run is cancelled, or
        ``timeout_s`` passes. Returns "approved", "declined" or None. Nothing is ever
        decided by default: a proposal stays pending until a human acts."""
        with self._decided:
            self._decided.wait_for(
                lambda: proposal_id in self._decisions or self.cancelled, timeout=timeout_s
            )
            return self._decisions.get(proposal_id)

    def log(
        self,
        message: str,
        level: Literal["debug", "info", "warning", "error"] = "info",
        stage: str = "",
    ) -> None:
        self.emit(LogEvent(message=message, level=level, stage=stage))


@runtime_checkable
class Stage(Protocol):
    """Read-only members, so a stage may narrow them (``config: TrainStageConfig``)."""

    @property
    def name(self) -> str: ...

    @property
    def config_model(self) -> type[BaseModel]: ...

    @property
    def config(self) -> BaseModel: ...

    def run(self, ctx: StageContext) -> GateOutcome: ...


@runtime_checkable
class PrestartableStage(Stage, Protocol):
    """A stage that can prepare ahead of its turn (the trainer places and warms its
    fleet while data prep runs). ``run`` must work whether or not ``prestart`` ran;
    ``abandon`` releases what ``prestart`` took when the stage never runs."""

    def prestart(self, ctx: StageContext) -> None: ...

    def abandon(self) -> None: ...
