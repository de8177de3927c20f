"""The driver side of a training run: the coordinator of its parts.

``TrainingEngine`` runs inside the stage's caller (a RunDriver actor, or a test's
driver). It polls every rank (each answers a ``RankPoll``: its buffered events and its
``RankReport``), forwards the events to ``emit``, and hands each report to the part
that owns its meaning:

- ``RankPolls`` (polls.py) asks each rank and standby in its turn, and hands out
  the answers;
- ``RankLauncher`` (launcher.py) makes the ranks and the lighthouse, or takes over
  the ranks a ``Fleet`` holds from the previous run, and leaves its own there;
- ``GroupSupervisor`` (supervision.py) keeps each replica group's health and turns
  losses into ``InterruptionEvent``s; ``StandbyPool`` (standby.py) keeps warm standby
  groups to take a lost group's place;
- ``PhaseRelease`` (phase_release.py) runs a phase's gate once every live rank waits
  at its end; ``LossSpikeRelay`` (spike_relay.py) takes a loss spike to a human and
  the decision back to every rank.

A rank's own lifecycle is ``rank_state.RankState``. Recovery itself is not driven from
here: Ray restarts a dead actor (``max_restarts``) and the new process heals from a live
peer through torchft, or, when no group is left, loads the newest complete checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import JsonValue, TypeAdapter

from stages.checkpointing.storage import list_checkpoints
from stages.errors import ErrorCode, ItoError
from stages.event_buffer import expand_steps
from stages.events import (
    Event,
    EventPayload,
    FleetEvent,
    LogEvent,
    StepEvent,
)
from stages.resize import ResizeInbox
from stages.run_facts import RunFacts
from stages.run_secret import RunSecret
from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet.engine_state import EngineResult
from stages.trainer.fleet.handoff import Fleet, kill_actors
from stages.trainer.fleet.launcher import RankLauncher
from stages.trainer.fleet.phase_release import PhaseEndHook, PhaseRelease
from stages.trainer.fleet.polls import RankPolls
from stages.trainer.fleet.recovery import failure_time, failure_times
from stages.trainer.fleet.resize import GroupResizer
from stages.trainer.fleet.spike_relay import LossSpikeRelay
from stages.trainer.fleet.standby import StandbyPool
from stages.trainer.fleet.supervision import GroupSupervisor, RankKey
from stages.trainer.parallel.layout import BuiltLayout
from stages.trainer.rank.control import CommandName, CommandParams
from stages.trainer.rank.rank_state import ENDED_STATES, RankPoll, RankState
from stages.trainer.rank.replica import spare_name

_EVENT = TypeAdapter(Event)


class RunCancelled(Exception):
    """``cancel_event`` was set; every actor of the run has been killed."""


class TrainingEngine:
    def __init__(
        self,
        cfg: TrainStageConfig,
        *,
        run_id: str,
        checkpoint_dir: Path,
        role_shards: dict[str, list[str]] | None,
        emit: Callable[[Event], None],
        cancel_event: threading.Event,
        wait_decision: Callable[[str, float], str | None],
        facts: RunFacts | None = None,
        on_phase_end: PhaseEndHook | None = None,
        decided: set[int] | None = None,
        fleet: Fleet | None = None,
        secret: RunSecret | None = None,
        resize_inbox: ResizeInbox | None = None,
    ):
        self.cfg = cfg
        # None: the run's data is not ready yet; the fleet starts and warms up anyway,
        # and every rank gets the shards (``supply_data``) when they are.
        self.role_shards = dict(role_shards) if role_shards is not None else None
        self._data_sent: dict[RankKey, int] = {}  # rank -> pid that got the data
        self.ft = cfg.fault_tolerance
        # Ranks handed over by the previous run and left to the next.
        self.fleet = fleet
        self._handing_on = False
        self._standby_took_over = False
        self.checkpoint_dir = checkpoint_dir
        self.phase_ends = PhaseRelease(
            cfg.schedule, ft=self.ft, on_phase_end=on_phase_end, decided=decided or ()
        )
        self.emit_fn = emit
        self.cancel_event = cancel_event
        self.launcher = RankLauncher(
            cfg,
            run_id=run_id,
            checkpoint_dir=checkpoint_dir,
            facts=facts or RunFacts(),  # ``placement``: every actor on the booking's nodes
            fleet=fleet,
            # The run's secret (StageContext.secret), handed to every rank.
            secret=secret if secret is not None else RunSecret.new(),
            emit=self.emit,
            announce=self._fleet_changed,
        )
        self.supervisor = GroupSupervisor(
            cfg.replica_groups,
            ranks_per_group=cfg.ranks_per_group,
            ft=self.ft,
            emit=self.emit,
            replace=self._promote_spare,
            restart=lambda key: self.launcher.restart_group(self.actors, key),
            failure_time=failure_time,
            failure_times=failure_times,
        )
        self.groups = self.supervisor.groups
        self.actors: dict[RankKey, Any] = {}
        self.polls = RankPolls(self.ft.poll_interval_s)
        self.standby = StandbyPool(
            ranks_per_group=cfg.ranks_per_group,
            name=lambda index, rank: spare_name(self.launcher.names_id, index, rank),
            make=lambda name, rank, index, placement, place: self.launcher.make_worker(
                name, -1, rank, standby_index=index, placement=placement, place=place
            ),
            due=self.polls.due,
            announce=self._fleet_changed,
        )
        # step -> tokens of its last committed report: every group's rank 0 reports the
        # quorum's tokens of the same step, and a redone step replaces its first run.
        self.step_tokens: dict[int, int] = {}
        self.final_loss: float | None = None
        self.max_step = 0
        self.spikes = LossSpikeRelay(
            cfg,
            checkpoint_dir=checkpoint_dir,
            emit=self.emit,
            wait_decision=wait_decision,
            cancel_event=cancel_event,
        )
        self._ready: set[RankKey] = set()
        self._started = False
        self.layout: BuiltLayout | None = None
        self.rank_digests: dict[str, str] = {}
        self._reactivated: set[int] = set()
        # The booking's size changes, applied at a step every group agrees on.
        self.resizer = GroupResizer(self, resize_inbox)
        self.resized = False

    # --- lifecycle --------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        if not event.stage:
            event.stage = "train"
        self.emit_fn(event)

    def start_in_background(self) -> None:
        """Place and start the fleet while the caller goes on (data prep, tokenizing);
        ``run`` waits for it."""
        self.launcher.start_in_background(self.actors)

    def supply_data(self, role_shards: dict[str, list[str]]) -> None:
        """The run's token shards: sent to every rank waiting for them (at its next
        poll, and again to a process Ray restarted)."""
        self.role_shards = dict(role_shards)

    @property
    def _fleet_can_carry(self) -> bool:
        """Whether this run's ranks can go on to the next run: not after a standby took a
        group's place (Ray would restart it as the standby it was made as, with that
        standby's assignment file, and a multi-rank group's ranks find their rank 0 by
        the group's name)."""
        return not self._standby_took_over and not self.resized

    def _fleet_changed(self, event: FleetEvent, message: str) -> None:
        """The fleet change as structure, and its line for people."""
        self.emit(event)
        self.emit(LogEvent(message=message))

    def _promote_spare(self, key: RankKey) -> bool:
        """Put a warm standby group in the place of lost group ``key[0]``
        (``StandbyPool.stand_in``). False: no standby group is warm."""
        if self.standby.stand_in(key[0], self.actors, self.polls.in_flight) is None:
            return False
        self._standby_took_over = True
        return True

    def shutdown(self) -> None:
        """Kill every actor this engine made or took over (cancel, finish or failure; a
        fleet still being placed is first let finish, so no actor outlives this), but
        leave the ranks to the fleet when every one of them finished this run."""
        self.launcher.join()

        lighthouse = self.launcher.lighthouse
        ending = [] if self._handing_on else [*self.actors.values(), lighthouse]
        if self.fleet is not None and self.actors:  # not yet shut down
            self.fleet.actors = dict(self.actors) if self._handing_on else {}
            self.fleet.placed = {}  # the run is over: nothing borrows its ranks now
            if self._handing_on:  # the lighthouse goes on with the ranks
                self.fleet.lighthouse, self.fleet.lighthouse_settings = lighthouse, self.ft
        kill_actors(*ending, *self.standby.release(), *self.resizer.shutdown())
        self.actors.clear()
        self.launcher.lighthouse = None

    # --- polling ----------------------------------------------------------------------
    def poll_once(self, timeout_s: float) -> None:
        ready = self.polls.send_and_wait(self.actors, self.standby, timeout_s)
        now = time.time()
        for key, answer in self.polls.answers(ready):
            if isinstance(answer, RankPoll):
                self._on_reply(key, answer, now)
            else:
                self.supervisor.rank_down(key, now, answer)
        self.supervisor.check_stuck(now)

    def _on_reply(self, key: RankKey, reply: RankPoll, now: float) -> None:
        g, rank = key
        status = reply.report
        if status.state is RankState.standby and status.pid not in self._reactivated:
            # A standby that had taken this group's place died and Ray restarted it:
            # it came back as a standby; it is this group's rank again.
            self._reactivated.add(status.pid)
            self.actors[key].command.remote("activate", self.standby.activation(g, rank))
        if status.state is RankState.ready:
            self._ready.add(key)
        if (
            status.state is RankState.awaiting_data
            and self.role_shards is not None
            and self._data_sent.get(key) != status.pid
        ):
            self._data_sent[key] = status.pid
            self.actors[key].command.remote("data", {"role_shards": self.role_shards})
        self.supervisor.rank_answered(key, status, now)
        if status.gpu_ids:
            self.standby.gpu_ids[key] = list(status.gpu_ids)
        if rank == 0 and status.layout:
            self.layout = status.layout.copy()
        sooner = self.phase_ends.observe(key, status, self.actors[key], len(self.actors))
        if sooner is not None:
            self.polls.sooner(key, sooner)
        if status.digest:
            self.rank_digests[f"{g}/{rank}"] = status.digest
        self.forward_events(reply.events, g)
        self.spikes.reported(status, g, now)

    def forward_events(self, events: list[EventPayload], group: int) -> None:
        """A poll's events of a rank of ``group`` (a resize's joining and leaving ranks'
        too: a drained group's last checkpoint is the run's)."""
        for raw in events:
            for one in expand_steps(raw) if raw.get("kind") == "step" else (raw,):
                self._on_event(_EVENT.validate_python(one), group)

    def _on_event(self, event: Event, group: int) -> None:
        if isinstance(event, StepEvent) and not event.committed:
            self.supervisor.step_failed()
        if isinstance(event, StepEvent) and event.committed:
            self.step_tokens[event.step] = event.tokens
            if event.step >= self.max_step:
                self.max_step = event.step
                self.final_loss = event.loss
            self.supervisor.step_committed(event, group)
            self.resizer.step_committed(event)
            if (spike := self.spikes.recovered()) is not None:
                detected, detail = spike
                self.supervisor.interruption("loss_spike", None, detected, event.ts, detail)
        self.emit(event)

    def forget_rank(self, key: RankKey) -> tuple[Any, Any]:
        """Stop polling rank ``key`` (a group a resize drains); returns its actor and
        its poll in flight (None): the reply holds events its buffer no longer has."""
        self._data_sent.pop(key, None)
        self._ready.discard(key)
        self.rank_digests.pop(f"{key[0]}/{key[1]}", None)  # the run's end compares members'
        in_flight = self.polls.forget(key)
        return self.actors.pop(key), in_flight

    def adopt_rank(self, key: RankKey, actor: Any, in_flight: Any = None) -> None:
        """Poll rank ``key`` from now on (a group a resize added, in training), starting
        with the reply to ``in_flight``, its poll not yet answered (None: none)."""
        self.actors[key] = actor
        self._ready.add(key)
        if in_flight is not None:
            self.polls.in_flight[key] = in_flight

    # --- commands ---------------------------------------------------------------------
    def command_all(self, kind: CommandName, params: CommandParams | None = None) -> None:
        import ray

        refs = [a.command.remote(kind, params or {}) for a in self.actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=self.ft.stop_timeout_s)

    def _stop_gracefully(self) -> None:
        """Cancel: every rank stops at its next step boundary and reports what it still
        holds (a checkpoint committed since its last poll: it is on disk, so the run's
        record must list it), for at most ``stop_timeout_s``; then every actor is killed."""
        self.command_all("stop")
        deadline = time.time() + self.ft.stop_timeout_s
        while time.time() < deadline and any(
            (r := self.supervisor.reports.get(key)) is None or r.state not in ENDED_STATES
            for key in self.actors
        ):
            self.poll_once(self.ft.poll_interval_s)

    # --- the supervision loop ---------------------------------------------------------
    def run(self) -> EngineResult:
        try:
            self.launcher.wait_started(self.actors)
            if self.role_shards is None:
                raise ItoError(ErrorCode.internal_error, "the engine ran before its data")
            while True:
                if self.cancel_event.is_set():
                    self._stop_gracefully()
                    raise RunCancelled()
                self.poll_once(self.ft.poll_interval_s)
                if not self._started and len(self._ready) == len(self.actors):
                    # Every rank built its model: release them into one first quorum.
                    self.command_all("go")
                    self._started = True
                    # Standbys warm up once the fleet trains: their start-up never
                    # takes CPU from the fleet's own on the way to its first step.
                    for _ in range(self.cfg.spare_groups):
                        self.standby.start_one()
                if self.spikes.pending is not None:
                    self.spikes.relay(self)
                    continue
                if self._started:
                    self.resizer.advance()
                    if self.resizer.paused:
                        continue  # no group trains: nothing can finish or end a phase
                if self._gate_ran() and self.phase_ends.stopped_at_phase is not None:
                    break
                if self.supervisor.every_rank_finished(set(self.actors)):
                    self._handing_on = self.fleet is not None and self._fleet_can_carry
                    break
                if self.supervisor.stragglers_done():
                    break
            self.supervisor.unrecovered()
        finally:
            self.shutdown()
        records = list_checkpoints(self.checkpoint_dir)
        return EngineResult(
            steps=self.max_step,
            tokens=sum(self.step_tokens.values()),
            final_loss=self.final_loss,
            interruptions=self.supervisor.interruptions,
            checkpoints=[r.step for r in records],
            final_checkpoint=records[-1].path if records else None,
            proposals=self.spikes.proposals,
            digests={g.index: g.digest for g in self.groups.values() if g.digest},
            layout=self.layout,
            rank_digests=self.rank_digests,
            stopped_at_phase=self.phase_ends.stopped_at_phase,
        )

    def evaluate_on_rank(
        self, request: dict[str, JsonValue], timeout_s: float
    ) -> dict[str, JsonValue]:
        """A phase's battery and export on the ranks waiting at its end
        (``phase_eval.evaluate_phase_end``); returns ``PhaseEvalReply``."""
        from stages.trainer.phase_eval import evaluate_phase_end

        live = self.supervisor.live() or [0]
        return evaluate_phase_end(self.actors, live, request, timeout_s)

    def _gate_ran(self) -> bool:
        """Every live rank waits at one phase end: its gate ran (``PhaseRelease``)."""
        live = [k for k in self.actors if self.groups[k[0]].lost_at is None]
        return self.phase_ends.gate(
            live,
            list(self.actors),
            self.supervisor.reports,
            release=lambda: self.command_all("next_phase"),
        )
