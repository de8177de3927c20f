"""Running runs follow their booking's nodes: the supervisor's half of a resize.

When an operator adds nodes to or takes nodes back from a booking
(``ito-backend bookings add-nodes`` / ``remove-nodes``), each of the booking's
running (or capacity-paused) runs gets the planner's new replica-group count
(``gates.planning.resize_groups``: the layout inside each group unchanged) as a
``stages.resize.ResizeRequest`` through its driver, which hands it to the trainer
(applied at a step boundary; a resize while a phase ends or a checkpoint saves waits
there, it is the trainer's to order).

Every answer is a row of ``run_resizes`` first, then delivered: a driver that does
not answer keeps it ``pending`` and the next pass sends it again (queued, never
dropped; the request id is the same, and the trainer's inbox keeps only the newest);
a newer change of the booking supersedes it. A run that grows gets the nodes its
booking gained reserved first (``placement.reserve_added``): until they joined the
request waits, pending.
A request of 0 groups pauses the run (``paused_capacity``); the next one of at least
one group resumes it. The supervisor writes no events into a live driver's sequence:
its decisions are the ``run_resizes`` rows and log lines, the trainer's progress is
its ``ResizeEvent``\\ s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from orchestrator.db.store import Row, Store
from orchestrator.gates.planning import plan_gpus_per_node, resize_groups, run_plan
from orchestrator.runs import RunState
from orchestrator.runtime.placement import PlacementPending
from stages.errors import ErrorCode, ItoError
from stages.resize import ResizeRequest
from stages.run_facts import PlacementFact

log = logging.getLogger(__name__)

# The interruptions after which the supervisor launched the run's driver again.
RELAUNCHED = ("driver_lost", "node_lost")
# Runs whose booking changes are followed (the driver lives and trains, or waits).
FOLLOWING = (RunState.running, RunState.paused_capacity)
# Hands a request to a run's driver (a handle from ``driver_of``); raises when the
# driver did not take it. The supervisor's is a Ray call with its RPC timeout.
Deliver = Callable[[Any, dict[str, Any]], None]
# Reserves the nodes a booking change added to a run: (run_id, change_id, booking,
# the added nodes' names) -> their placement (None: the run's own group serves, on the
# embedded head); raises ``PlacementPending`` until they joined
# (``placement.reserve_added``).
Place = Callable[[str, int, dict[str, Any], tuple[str, ...]], PlacementFact | None]
# The Ray nodes (hex ids) that are the named booking nodes, all or none
# (``placement.node_ids``): the trainer drains the groups on the others.
Locate = Callable[[Sequence[str]], tuple[str, ...]]


ResizeStatus = Literal["pending", "delivered", "refused", "unchanged", "superseded"]


class ResizeRecord(BaseModel):
    """A row of ``run_resizes``: the supervisor's answer to one booking change."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_id: str
    request_id: str
    change_id: int
    requested_at: float
    nodes: list[str]  # the booking's nodes after the change
    groups_before: int
    replica_groups: int
    reason: str
    code: str | None = None  # the planner's refusal
    status: ResizeStatus
    # Set by the store: when it was written, when the driver took it.
    created_at: float | None = None
    delivered_at: float | None = None

    def row(self) -> Row:
        """What the store writes (it stamps ``created_at`` itself)."""
        return self.model_dump(exclude={"created_at", "delivered_at"})


def _unlocated(names: Sequence[str]) -> tuple[str, ...]:
    return ()


def ray_deliver(timeout_s: float) -> Deliver:
    def deliver(handle: Any, request: dict[str, Any]) -> None:
        import ray

        ray.get(handle.resize.remote(request), timeout=timeout_s)

    return deliver


class Resizer:
    """Answers booking changes of running runs; ``follow`` is one pass."""

    def __init__(
        self,
        store: Store,
        driver_of: Callable[[str], Any | None],
        deliver: Deliver,
        place: Place,
        *,
        locate: Locate = _unlocated,
    ):
        self.store = store
        self.driver_of = driver_of
        self.deliver = deliver
        self.place = place
        self.locate = locate
        # The request each run's driver has, by the driver it went to: a relaunched
        # driver gets the run's latest size again (once), since its trainer starts
        # from the run's plan.
        self._delivered_to: dict[str, tuple[str, object]] = {}

    def follow(self, runs: list[Row]) -> None:
        for run in runs:
            if run["state"] not in FOLLOWING:
                continue
            try:
                self.follow_run(run)
            except ItoError as e:
                if e.code in (ErrorCode.store_unavailable, ErrorCode.lease_lost):
                    raise
                log.exception("resize of run %s failed", run["run_id"])

    def follow_run(self, run: Row) -> None:
        """Answer the booking's changes since the run's last answer (a newer change
        supersedes an answer not delivered yet), then deliver the pending one."""
        run_id = run["run_id"]
        plan = run_plan(self.store, run)
        if plan is None:
            return  # not planned yet: it plans on the booking as it is then
        records = [ResizeRecord.model_validate(r) for r in self.store.run_resizes(run_id)]
        since = records[-1].change_id if records else 0
        changes = self.store.booking_changes(run["booking_id"], after_change_id=since)
        if not records:  # changes before the run was accepted are in its plan already
            changes = [c for c in changes if c["ts"] > run["created_at"]]
        pending = records[-1] if records and records[-1].status == "pending" else None
        delivered = [r for r in records if r.status == "delivered"]
        if changes:
            if pending is not None:
                self.store.mark_resize(run_id, pending.request_id, "superseded")
            pending = self._answer(run, plan, changes, delivered[-1] if delivered else None)
        if pending is not None:
            self._send(run, pending, delivered[-1] if delivered else None)
        elif delivered and self._relaunched_since(run_id, delivered[-1].delivered_at):
            self._send(run, delivered[-1], delivered[-2] if len(delivered) > 1 else None)

    def _relaunched_since(self, run_id: str, delivered_at: float | None) -> bool:
        """Whether the run's driver was relaunched (lost, then launched again) after
        ``delivered_at``: its trainer then starts from the run's plan."""
        lost = self.store.list_events(run_id, kinds=["interruption"], limit=100_000)
        return any(
            e["payload"].get("interruption_kind") in RELAUNCHED and e["ts"] > (delivered_at or 0)
            for e in lost
        )

    def _answer(
        self, run: Row, plan: Row, changes: list[Row], last: ResizeRecord | None
    ) -> ResizeRecord | None:
        """Record the planner's answer to ``changes`` (against the run's last delivered
        size, else its plan); returns it when it is to be sent."""
        run_id = run["run_id"]
        booking = self.store.booking(run["booking_id"])
        if booking is None or booking["state"] != "active":
            return None  # the authority check stops the run
        latest = changes[-1]
        nodes = self.store.booking_nodes(run["booking_id"])
        gpn = plan_gpus_per_node(plan, booking)  # the trainer's: not the rollout fleet's
        if last is not None:
            groups_before = last.replica_groups
            gpus_before = len(last.nodes) * gpn
            removed = bool(set(last.nodes) - set(nodes))
        else:
            groups_before = int(plan["dp_replicate"])
            gpus_before = int(plan.get("gpus_per_node", gpn)) * int(plan.get("node_count", 0))
            removed = any(c["action"] == "remove" for c in changes)
        record = ResizeRecord(
            run_id=run_id,
            request_id=f"{run_id}:c{latest['change_id']}",
            change_id=latest["change_id"],
            requested_at=latest["ts"],
            nodes=nodes,
            groups_before=groups_before,
            replica_groups=groups_before,
            reason="",
            status="pending",
        )
        try:
            count = resize_groups(
                plan, booking, current_groups=groups_before, grew=len(nodes) * gpn > gpus_before
            )
        except ItoError as e:
            refused = {"reason": e.message, "code": str(e.code), "status": "refused"}
            self.store.insert_resize(record.model_copy(update=refused).row())
            self.store.add_log(run_id, f"resize refused: {e.code}: {e.message}", "warning")
            return None
        record = record.model_copy(
            update={"replica_groups": count.replica_groups, "reason": count.reason}
        )
        if count.replica_groups == groups_before and not removed:
            self.store.insert_resize(record.model_copy(update={"status": "unchanged"}).row())
            self.store.add_log(run_id, f"booking changed; groups stay {groups_before}")
            return None
        self.store.insert_resize(record.row())
        return record

    def _send(self, run: Row, record: ResizeRecord, last: ResizeRecord | None) -> None:
        """Deliver ``record`` (pending, or delivered to an earlier driver of the run)."""
        run_id = run["run_id"]
        handle = self.driver_of(run_id)
        if handle is None:
            return  # pending: the next pass sends it again
        # A Ray actor handle's id names the driver (a relaunch is another one).
        driver = getattr(handle, "_actor_id", None) or id(handle)
        again = record.status == "delivered"
        if again and self._delivered_to.get(run_id) == (record.request_id, driver):
            return
        before, after = record.groups_before, record.replica_groups
        placed: PlacementFact | None = None
        if after > 0:
            # The nodes gained since the last delivered size (else since the plan: the
            # nodes this run's changes added) hold the added groups: those of a grow, and
            # those that move off the nodes a swap took back.
            gained = self._gained(run, record, last)
            booking = self.store.booking(run["booking_id"])
            if gained and booking is not None:
                try:
                    placed = self.place(run_id, record.change_id, booking, gained)
                except PlacementPending as e:  # the nodes have not joined: next pass
                    self.store.set_state_reason(run_id, f"resize to {after} groups: {e}")
                    return
        request = ResizeRequest(
            request_id=record.request_id,
            replica_groups=after,
            nodes=tuple(record.nodes),
            requested_at=record.requested_at,
            reason=record.reason[:500],
            placement=placed,
            # Which Ray nodes the booking's nodes are: the trainer drains the groups on
            # the others (the nodes taken back).
            node_ids=self.locate(record.nodes),
        )
        try:
            self.deliver(handle, request.model_dump(mode="json"))
        except Exception as e:  # unreachable or slow: still pending, sent again
            log.warning("resize %s not delivered yet: %s", request.request_id, type(e).__name__)
            return
        self._delivered_to[run_id] = (request.request_id, driver)
        if again:
            return
        self.store.mark_resize(run_id, request.request_id, "delivered")
        self.store.add_log(
            run_id, f"resize requested: {before} -> {after} replica group(s): {request.reason}"
        )
        state = RunState(self.store.get_run(run_id)["state"])
        if after == 0 and state == RunState.running:
            self.store.transition(
                run_id,
                RunState.paused_capacity,
                f"the booking holds less than one replica group ({request.reason})",
            )
        elif after > 0 and state == RunState.paused_capacity:
            self.store.transition(
                run_id, RunState.running, f"capacity returned: {after} replica group(s)"
            )

    def _gained(self, run: Row, record: ResizeRecord, last: ResizeRecord | None) -> tuple[str, ...]:
        """The nodes of ``record`` the run had no reservation on, in the booking's order."""
        if last is not None:
            new = set(record.nodes) - set(last.nodes)
        else:
            new = set()
            for c in self.store.booking_changes(run["booking_id"]):
                if c["ts"] > run["created_at"] and c["change_id"] <= record.change_id:
                    nodes = set(c["nodes"])
                    new = new | nodes if c["action"] == "add" else new - nodes
        return tuple(n for n in record.nodes if n in new)
