"""A loss spike, from the rank that paused for it to the human and back.

A rank whose loss spiked pauses at that step and reports it (``RankReport.spike``).
The driver pauses every group, proposes a restart from the newest checkpoint before
the spike (skipping the batches that spiked), waits for the human's decision, and
sends every rank ``restore`` (approved) or ``resume``. An approved restart is an
interruption from the spike until the next committed step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stages.checkpointing.storage import list_checkpoints
from stages.events import Event, LogEvent, PhaseEvent
from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet.supervision import GroupState
from stages.trainer.rank.control import CommandName, CommandParams
from stages.trainer.rank.loss_spike import LossSpikeDetector, ReportedSpike
from stages.trainer.rank.rank_state import RankReport


class SpikeHost(Protocol):
    """What the relay needs of the engine: its groups, a poll, a command to every rank."""

    groups: dict[int, GroupState]

    def poll_once(self, timeout_s: float) -> None: ...
    def command_all(self, kind: CommandName, params: CommandParams | None = None) -> None: ...


@dataclass(frozen=True)
class PendingSpike:
    """A spike waiting to be relayed: as its rank reported it, its group, and when the
    driver saw it."""

    spike: ReportedSpike
    group: int
    at: float


class LossSpikeRelay:
    def __init__(
        self,
        cfg: TrainStageConfig,
        *,
        checkpoint_dir: Path,
        emit: Callable[[Event], None],
        wait_decision: Callable[[str, float], str | None],
        cancel_event: threading.Event,
    ):
        self.cfg, self.ft = cfg, cfg.fault_tolerance
        self.checkpoint_dir = checkpoint_dir
        self.emit = emit
        self.wait_decision = wait_decision
        self.cancel_event = cancel_event
        self.proposals: list[str] = []
        self.pending: PendingSpike | None = None
        # An approved restart's (detected, detail), until the next committed step.
        self._recovering: tuple[float, str] | None = None
        self._handled: set[tuple[int, int]] = set()  # (step, batch) already relayed

    def reported(self, report: RankReport, group: int, now: float) -> None:
        """Take in a rank's report: a new spike it paused for is pending."""
        spike = report.spike
        if spike and report.paused_at is not None and self.pending is None:
            # A poll in flight during the last decision may still show that spike.
            key = (spike.step, spike.batch)
            if key not in self._handled:
                self._handled.add(key)
                self.pending = PendingSpike(spike, group, now)

    def recovered(self) -> tuple[float, str] | None:
        """At a committed step: the approved restart it ends (detected, detail), once."""
        done, self._recovering = self._recovering, None
        return done

    def relay(self, host: SpikeHost) -> None:
        """Pause every group, propose the restart, and send every rank the decision."""
        pending = self.pending
        assert pending is not None
        spike = pending.spike
        host.command_all("pause")
        # Let every live group reach its pause (a straggler may first wait out the join
        # timeout), so their last steps and saves are reported before the proposal.
        deadline = time.time() + self.ft.join_timeout_ms / 1000 + self.ft.stop_timeout_s
        while (
            time.time() < deadline
            and not self.cancel_event.is_set()
            and not all(
                g.paused or g.lost_at is not None or g.finished for g in host.groups.values()
            )
        ):
            host.poll_once(self.ft.poll_interval_s)
        # Restart from before the spike: a checkpoint at the spike step holds its update.
        candidates = [r.step for r in list_checkpoints(self.checkpoint_dir) if r.step < spike.step]
        if not candidates:
            self.emit(
                LogEvent(
                    level="warning",
                    message=f"loss spike at step {spike.step} but no checkpoint "
                    "to restart from; continuing",
                )
            )
            host.command_all("resume")
            self.pending = None
            return
        ckpt = candidates[-1]
        detector = LossSpikeDetector(self.cfg.loss_spike)
        proposal = detector.propose(spike, ckpt)
        proposal.stage = "train"
        self.proposals.append(proposal.proposal_id)
        self.emit(proposal)
        paused_at = time.time()
        decision = self._await_decision(host, proposal.proposal_id)
        self.emit(PhaseEvent(phase="idle", start=paused_at, end=time.time()))
        detail = f"loss spike at step {spike.step}: {decision or 'no decision'}"
        if decision == "approved":
            host.command_all(
                "restore", {"step": ckpt, "skip_batches": proposal.params["skip_batches"]}
            )
            self._recovering = (pending.at, detail)
        else:
            host.command_all("resume")
        self.emit(LogEvent(message=detail))
        self.pending = None

    def _await_decision(self, host: SpikeHost, proposal_id: str) -> str | None:
        waited = 0.0
        limit = self.ft.decision_timeout_s
        while not self.cancel_event.is_set():
            decision = self.wait_decision(proposal_id, self.ft.decision_poll_s)
            if decision is not None:
                return decision
            host.poll_once(0)  # keep draining events while paused
            waited += self.ft.decision_poll_s
            if limit is not None and waited >= limit:
                return None
        return None
