"""A resize of a running run's replica groups, applied at one step every group agreed on.

``GroupResizer`` takes the booking's new group count (``stages.resize.ResizeRequest``)
from the run's inbox and moves the fleet through ``ResizeStage``:

- ``launching`` (grow): the new groups' ranks start (on the nodes the booking gained)
  and build their model while the run trains on; they wait at ``ready``. A new group
  that an idle warm standby becomes skips this (it is built and warm): the standby is
  promoted, and a replacement standby starts on the gained nodes in the background.
- ``holding``: every rank votes in its next step's reduction to hold at that step's
  end (``Control.hold``), so all groups stop after the same step ``P`` (``held``).
- ``joining`` (grow): the new groups are released (a promoted standby is activated as
  the new group, as a lost group's stand-in is); each joins the quorum of step ``P``,
  where torchft heals it from a live peer (no checkpoint is read), and from step
  ``P + 1`` the batch is shared by the new members.
- shrink: the leaving groups are told to stop (drained at ``P``, never killed
  mid-step) and the others share the batch from step ``P`` on.
- ``settling``: the first committed step with the new member count applies the resize
  (a ``ResizeEvent`` with the seconds from the booking change to that step).

The global batch stays fixed: each member's share is re-cut (``rank.membership``), so
no sequence is trained twice or skipped, and the loss stays the same function of the
tokens seen. A request that cannot be applied is refused with its reason; one that
comes while another is under way waits for it (the newest replaces a waiting one).
A grow's new ranks are ``resize_grow.GrowLaunch``'s; a refusal's reason is
``resize_checks.resize_refusal``'s.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Protocol

from stages.events import (
    Event,
    EventPayload,
    FleetEvent,
    LogEvent,
    ResizeAction,
    ResizeEvent,
    StepEvent,
)
from stages.resize import ResizeInbox, ResizeRequest, groups_off_booking
from stages.trainer.config import FaultToleranceConfig, TrainStageConfig
from stages.trainer.fleet.handoff import kill_actors
from stages.trainer.fleet.launcher import RankLauncher
from stages.trainer.fleet.resize_checks import resize_refusal
from stages.trainer.fleet.resize_grow import GrowLaunch
from stages.trainer.fleet.resize_polls import ResizePolls
from stages.trainer.fleet.standby import StandbyPool
from stages.trainer.fleet.supervision import GroupState, GroupSupervisor, RankKey
from stages.trainer.rank.control import CommandName, CommandParams
from stages.trainer.rank.rank_state import RankState
from stages.trainer.rank.replica import worker_name


class ResizeHost(Protocol):
    """What the resizer needs of the engine: its ranks and groups, their launcher and
    supervisor, a command to every rank, and a rank's move in or out of its polls."""

    cfg: TrainStageConfig
    ft: FaultToleranceConfig
    actors: dict[RankKey, Any]
    groups: dict[int, GroupState]
    supervisor: GroupSupervisor
    launcher: RankLauncher
    standby: StandbyPool
    role_shards: dict[str, list[str]] | None
    max_step: int
    resized: bool

    def emit(self, event: Event) -> None: ...
    def command_all(self, kind: CommandName, params: CommandParams | None = None) -> None: ...
    def forget_rank(self, key: RankKey) -> tuple[Any, Any]: ...
    def adopt_rank(self, key: RankKey, actor: Any, in_flight: Any = None) -> None: ...
    def forward_events(self, events: list[EventPayload], group: int) -> None: ...


class ResizeStage(StrEnum):
    idle = "idle"
    launching = "launching"  # new groups' ranks build their model
    holding = "holding"  # every group is asked to stop after one agreed step
    joining = "joining"  # new groups released: they join the quorum and heal
    settling = "settling"  # waiting for the first step with the new member count
    pausing = "pausing"  # below one group: every group saves and stops
    paused = "paused"  # no group left: waiting for capacity to come back


class GroupResizer:
    def __init__(self, engine: ResizeHost, inbox: ResizeInbox | None):
        self.engine = engine
        self.inbox = inbox
        self.stage = ResizeStage.idle
        self.request: ResizeRequest | None = None
        self.before = 0
        # Ranks of groups being added (polled here until they train) and of groups
        # leaving (polled here until they stopped).
        self.joining: dict[RankKey, Any] = {}
        self.leaving: dict[RankKey, Any] = {}
        # A grow's new ranks: launched or promoted standbys, and the nodes they run on.
        self.grow = GrowLaunch(engine, self._log_progress)
        self.polls = ResizePolls(engine.forward_events)
        self.members: tuple[int, ...] = ()
        self.first_step = 0
        self._leaving_since = 0.0
        # Group indices are never reused: a new group's ranks have names of their own.
        self._next_group = engine.cfg.replica_groups
        # The step the run paused at for capacity (its checkpoint's), None while it trains.
        self.paused_at: int | None = None
        # A swap's second move (groups added on the nodes the booking gained), begun
        # once its first (the groups on the nodes it took back drained) is applied.
        self._then: ResizeRequest | None = None
        # Launches of the current grow's new groups (a failed one is launched again).
        self._launches = 0

    @property
    def paused(self) -> bool:
        """No group trains (the booking held less than one): from the pause until the
        groups that resume the run are in."""
        return self.paused_at is not None

    # --- the moves --------------------------------------------------------------------
    def advance(self) -> None:
        """One look at the resize under way (or a new request), from the engine's loop."""
        self._poll_leaving()
        if self.stage in (ResizeStage.idle, ResizeStage.paused):
            # A newer request replaces a swap's second move (it says the whole booking).
            request = self.inbox.take() if self.inbox is not None else None
            request, self._then = request or self._then, None
            if request is not None:
                self._begin(request)
        elif self.stage is ResizeStage.launching and self._poll(
            launched := {k: a for k, a in self.joining.items() if k not in self.grow.promoted},
            {RankState.ready},
        ):
            launched_at = self.grow.launched_at
            since = self.request.requested_at if self.request else launched_at
            self._log_progress(
                f"the new groups are built and warm (from the booking change: ranks "
                f"launched {launched_at - since:.2f}s, "
                f"{self.polls.launch_breakdown(launched, since)})"
            )
            if self.paused_at is None:
                self._hold()
            else:  # nothing to hold: the run resumes from its checkpoint
                self._release_joining()
        elif self.stage is ResizeStage.pausing and not self.leaving:
            self._paused()
        elif self.stage is ResizeStage.holding and (held := self._held_at()) is not None:
            self._change(held)
        elif self.stage is ResizeStage.joining and self._poll(self.joining, {RankState.training}):
            self._admit()

    def step_committed(self, event: StepEvent) -> None:
        """A committed step: the first one with the new member count applies the resize."""
        if (
            self.stage is ResizeStage.settling
            and self.request is not None
            and event.batch_share is not None
            and event.batch_share[1] == len(self.members)
            and event.step > self.first_step
        ):
            request, self.request = self.request, None
            self.stage = ResizeStage.idle
            done = self._report(
                request,
                "applied",
                len(self.members),
                step=event.step,
                seconds=max(0.0, event.ts - request.requested_at),
            )
            self.engine.emit(
                LogEvent(
                    message=f"resize {request.request_id}: {self.before} -> "
                    f"{len(self.members)} replica groups from step {self.first_step + 1}, "
                    f"{done.seconds:.2f}s after the booking changed"
                )
            )

    def groups_off(self, request: ResizeRequest) -> tuple[int, ...]:
        """The live groups with a rank on a node the booking took back (none where the
        ranks' nodes or the booking's are not known)."""
        # A group just added may not have answered the engine's own poll yet: its
        # last report to this resizer stands in.
        reports = {**self.polls.reports, **self.engine.supervisor.reports}
        rank_nodes = {
            key: (report.node_id if (report := reports.get(key)) is not None else "")
            for key in self.engine.actors
        }
        return groups_off_booking(rank_nodes, set(request.node_ids))

    def _begin(self, request: ResizeRequest) -> None:
        engine = self.engine
        live = sorted(engine.groups)
        self.before = len(live)
        off = self.groups_off(request)
        if off and len(live) - len(off) < request.replica_groups:
            # A swap: groups move off the nodes taken back. With the gained nodes reserved
            # the new groups start there first and join live groups (as a grow does),
            # then the groups on the nodes taken back drain; else (or when the batch does
            # not split over the groups in between) they drain first (none staying: the
            # run pauses), then groups start on the gained nodes. Never into the run's
            # own reservation: it holds the nodes taken back.
            staying = len(live) - len(off)
            grow = request.model_copy(
                update={"replica_groups": len(live) + request.replica_groups - staying}
            )
            drain = request.model_copy(update={"replica_groups": staying})
            if request.placement is not None or engine.launcher.facts.placement is None:
                self._then = request
            else:
                engine.emit(
                    LogEvent(
                        level="warning",
                        message=f"resize {request.request_id}: groups {list(off)} leave the "
                        "nodes taken back; no node the booking gained is reserved to move "
                        "them to, so the run goes on with fewer groups",
                    )
                )
            placed = request.placement is not None
            request = grow if placed and not self.refusal(grow) else drain
        if request.replica_groups == len(live) and self.paused_at is None:
            # Already that size (a booking change that kept the count, a request resent
            # to a relaunched driver): nothing moves.
            self._report(
                request,
                "applied",
                self.before,
                step=engine.max_step,
                seconds=0.0,
                reason=f"the run already has {self.before} replica groups",
            )
            return
        refusal = self.refusal(request)
        self._report(
            request,
            "refused" if refusal else "requested",
            self.before if refusal else request.replica_groups,
            step=engine.max_step,
            reason=refusal or request.reason,
        )
        if refusal:
            self._then = None
            engine.emit(
                LogEvent(level="warning", message=f"resize {request.request_id}: {refusal}")
            )
            return
        self.request = request
        self._launches = 0
        if request.replica_groups > self.before:
            self._add_groups(request, live)
        elif request.replica_groups == 0:
            self.members = ()
            self._hold()
        else:
            leaving = [g for g in dict.fromkeys((*request.leaving_groups, *off)) if g in live]
            for g in sorted(live, reverse=True):
                if len(live) - len(leaving) <= request.replica_groups:
                    break
                if g not in leaving:
                    leaving.append(g)
            self.members = tuple(g for g in live if g not in leaving)
            self._hold()

    def _add_groups(self, request: ResizeRequest, live: list[int]) -> None:
        """Start the groups a grow adds to ``live`` (each launch's groups have indices,
        and so ranks' names, of their own)."""
        added = list(range(self._next_group, self._next_group + request.replica_groups - len(live)))
        self._next_group += len(added)
        self._launches += 1
        self.members = (*live, *added)
        # After a pause the new groups read the run's checkpoint (none is live to
        # heal from) and share the batch from its step; otherwise they heal.
        resume = None if self.paused_at is None else (self.paused_at, self.members)
        self.joining.update(self.grow.start(added, request, resume))
        if self.grow.promoted.keys() == self.joining.keys():  # nothing to build: hold now
            self._hold()
        else:
            self.stage = ResizeStage.launching

    def refusal(self, request: ResizeRequest) -> str:
        """Why ``request`` cannot be applied now ("" if it can)."""
        lost = self.engine.supervisor.live() != sorted(self.engine.groups)
        return resize_refusal(
            self.engine.cfg, request, paused=self.paused_at is not None, group_lost=lost
        )

    def _hold(self) -> None:
        """Ask every rank to hold after one step (all vote in that step's reduction)."""
        self.engine.command_all("hold")
        self.stage = ResizeStage.holding

    def _held_at(self) -> int | None:
        """The step every rank of the run holds at, once they all do."""
        reports = self.engine.supervisor.reports
        steps: set[int] = set()
        for key in self.engine.actors:
            report = reports.get(key)
            if report is None or report.state is not RankState.held or report.held_at is None:
                return None
            steps.add(report.held_at)
        return steps.pop() if len(steps) == 1 else None

    def _change(self, held: int) -> None:
        engine = self.engine
        self._log_progress(f"every group holds after step {held}")
        if self.joining:
            # The new groups heal in the quorum of step ``held`` and share from the next.
            self.first_step = held + 1
            self._release_joining()
            return
        if not self.members:
            # Below one group: the saving group checkpoints step ``held``; all stop.
            self.paused_at = self.first_step = held
            for key in list(engine.actors):
                self._take_leaving(key, "drain")
            for g in list(engine.groups):
                engine.supervisor.remove_group(g)
            self._leaving_since = time.monotonic()
            self.stage = ResizeStage.pausing
            return
        # Shrink: the leaving groups are drained here; the others share from ``held``.
        self.first_step = held
        for key in [k for k in engine.actors if k[0] not in self.members]:
            self._take_leaving(key, "stop")
        self._leaving_since = time.monotonic()
        drained = sorted({k[0] for k in self.leaving})
        staying = list(engine.actors)
        for g in drained:
            engine.supervisor.remove_group(g)
        engine.emit(
            FleetEvent(
                action="groups_drained",
                replica_group=drained[0] if drained else None,
                actors=[worker_name(engine.launcher.names_id, *k) for k in self.leaving],
                step=held,
            )
        )
        self._release(staying)

    def _report(
        self,
        request: ResizeRequest,
        action: ResizeAction,
        groups_after: int,
        *,
        step: int | None = None,
        seconds: float | None = None,
        reason: str = "",
    ) -> ResizeEvent:
        """Emit the trainer's word on ``request`` (from ``self.before`` groups)."""
        event = ResizeEvent(
            request_id=request.request_id,
            action=action,
            groups_before=self.before,
            groups_after=groups_after,
            step=step,
            seconds=seconds,
            reason=reason,
        )
        self.engine.emit(event)
        return event

    def _take_leaving(self, key: RankKey, command: str) -> None:
        """Poll rank ``key`` here until it stopped (``command``: stop, or drain to save
        first), its engine poll in flight with it (its reply holds its last events)."""
        actor, in_flight = self.engine.forget_rank(key)
        self.leaving[key] = actor
        if in_flight is not None:
            self.polls.in_flight[key] = in_flight
        actor.command.remote(command)

    def _log_progress(self, what: str) -> None:
        """A resize's milestone for SREs, with the seconds since the booking changed
        (where a slow grow spends its time)."""
        if self.request is not None:
            took = time.time() - self.request.requested_at
            self.engine.emit(
                LogEvent(message=f"resize {self.request.request_id}: {what} after {took:.2f}s")
            )

    def _release_joining(self) -> None:
        self.grow.release(self.joining)
        self.stage = ResizeStage.joining

    def _paused(self) -> None:
        """Every group saved and stopped: the run waits for capacity."""
        request = self.request
        self.stage = ResizeStage.paused
        if request is not None:
            self._report(
                request,
                "paused",
                0,
                step=self.paused_at,
                seconds=max(0.0, time.time() - request.requested_at),
                reason=request.reason,
            )
        self.engine.emit(
            LogEvent(
                message=f"paused for capacity at step {self.paused_at} (checkpointed): "
                "no replica group fits the booking"
            )
        )

    def _admit(self) -> None:
        """The new groups train (their quorum request is in): release the held groups."""
        engine = self.engine
        self._log_progress("the new groups ask for the quorum")
        held = list(engine.actors)
        for key, actor in self.joining.items():
            engine.supervisor.add_group(key[0])
            engine.adopt_rank(key, actor, self.polls.in_flight.pop(key, None))
        added = sorted({k[0] for k in self.joining})
        engine.emit(
            FleetEvent(
                action="groups_added",
                replica_group=added[0],
                actors=[
                    self.grow.promoted.get(k) or worker_name(engine.launcher.names_id, *k)
                    for k in self.joining
                ],
                step=self.first_step - 1,
            )
        )
        self.joining, self.grow.promoted = {}, {}
        if self.paused_at is not None:  # resumed: the new groups trained from the checkpoint
            self.paused_at = None
            self.engine.resized = True
            self.stage = ResizeStage.settling
            return
        self._release(held)

    def _release(self, held: list[RankKey]) -> None:
        """The held ranks train on, the batch shared by the new members."""
        self._send_members(held, list(self.members))
        self.engine.resized = True
        self.stage = ResizeStage.settling

    def _send_members(self, held: list[RankKey], members: list[int]) -> None:
        """Release the held ranks ``held``: ``members`` share the batch from
        ``first_step``."""
        params = {"first_step": self.first_step, "members": members}
        for key in held:
            self.engine.actors[key].command.remote("members", params)

    # --- polling the ranks this engine does not poll ------------------------------------
    def _poll(self, ranks: dict[RankKey, Any], states: set[RankState]) -> bool:
        """Whether every rank of ``ranks`` reports one of ``states`` (a failed one:
        ``_join_failed``)."""
        done, failure = self.polls.all_in(ranks, states, self.engine.role_shards)
        if failure:
            self._join_failed(failure)
            return False
        return done

    def _poll_leaving(self) -> None:
        """Kill the drained ranks once they stopped (or after their bound)."""
        if not self.leaving:
            return
        # Drained ranks stop at once; pausing, the saving one writes a checkpoint first.
        bound = (
            self.engine.ft.pause_save_timeout_s if self.paused else self.engine.ft.stop_timeout_s
        )
        overdue = time.monotonic() - self._leaving_since > bound
        ended = self.polls.ended(self.leaving)  # not answered yet: busy saving
        for key in list(self.leaving) if overdue else ended:
            kill_actors(self.leaving.pop(key))
            self.polls.forget(key)
        if not self.leaving:  # give back the reservations of gained nodes they drained
            self.grow.release_drained(set(self.engine.groups) | {k[0] for k in self.joining})

    def _join_failed(self, reason: str) -> None:
        """A new group's rank failed before it trained (its process died, its build
        failed): every new group of this launch is given up (one may already be in a
        quorum: none is admitted alone), the held groups train on as they were, and the
        grow starts fresh groups again, ``resize_join_attempts`` launches in all, after
        which it is refused."""
        engine, request = self.engine, self.request
        kill_actors(*self.joining.values())
        for key in self.joining:
            self.polls.forget(key)
            self.grow.placed.pop(key[0], None)
        self.joining, self.grow.promoted = {}, {}
        live = sorted(engine.groups)
        if self.stage is ResizeStage.joining and self.paused_at is None:
            # Every live rank holds after step ``first_step - 1``, waiting for its members.
            self._send_members(list(engine.actors), live)
        self.stage = ResizeStage.idle
        if request is None:
            return
        if self._launches < engine.ft.resize_join_attempts:
            engine.emit(
                LogEvent(
                    level="warning",
                    message=f"resize {request.request_id}: {reason}; the new groups start "
                    f"again (launch {self._launches + 1} of {engine.ft.resize_join_attempts})",
                )
            )
            self._add_groups(request, live)
            return
        self.request = None
        self._report(request, "refused", self.before, reason=reason)
        engine.emit(LogEvent(level="warning", message=f"resize refused: {reason}"))

    def shutdown(self) -> list[Any]:
        """The actors this resizer still holds (the engine kills them with the fleet)."""
        held = [*self.joining.values(), *self.leaving.values()]
        self.joining, self.leaving = {}, {}
        return held
