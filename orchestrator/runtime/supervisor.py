"""The run supervisor: the Ray implementation of ``RunRuntime`` inside the API server.

One loop thread owns every live run. Each tick, for every run in an active state,
it makes sure the run's detached ``RunDriver`` (``ito/run-<run_id>``) exists, pulls
its events, persists them (only the API server writes the store), and moves the
run along the one transition table. After an API-server restart the same loop
reattaches to live drivers by name: nothing is kept only in memory.

A run whose driver is gone (the Ray head restarted, the node died) is relaunched
from its persisted state: stages that already passed are skipped, and training
resumes from the newest complete checkpoint, because redoing hours of finished
work would waste the booking. After ``max_driver_attempts`` launches it fails
with ``driver_lost`` instead, so a run that keeps killing its driver stops.

Several API replicas may share one store; exactly one of them supervises. Each
loop turn takes or renews the ``supervisor`` lease in the store (by the database's
clock) and only its holder ticks runs; every write the supervisor makes goes
through ``Store.fenced``, which checks the lease's holder and fencing token in the
same transaction, so a leader that was paused or partitioned past its lease
changes nothing. A standby takes over within ``supervisor_lease_s`` (plus one
poll) of the leader's last renewal and starts from the store and Ray's named
drivers, as after a restart.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.db.store import Fence, Row, Store
from orchestrator.runs import ACTIVE, TERMINAL, RunState
from orchestrator.runtime import authority, driver_lifecycle, launch, placement, ray_cluster
from orchestrator.runtime.driver_lifecycle import (
    checkpoint_dir,
    driver_attempts,
    find_driver,
    launch_spec,
    node_lost,
    start_driver,
)
from orchestrator.runtime.interface import CleanupResult, Decision, remove_tree, run_dir
from orchestrator.runtime.ray_cluster import RaySettings
from orchestrator.runtime.resizing import Resizer, ray_deliver
from orchestrator.runtime.supervisor_settings import SupervisorSettings
from stages.errors import ErrorCode, ItoError
from stages.events import InterruptionEvent, LogEvent
from stages.run_facts import PlacementFact

if TYPE_CHECKING:
    from orchestrator.runtime.driver import DriverPoll

log = logging.getLogger(__name__)


LEASE_NAME = "supervisor"


class RayRuntime:
    def __init__(
        self,
        store: Store,
        var_dir: Path,
        ray: RaySettings,
        settings: SupervisorSettings | None = None,
    ):
        # This replica's claim on the lease; every supervisor write carries its token.
        self.fence = Fence(
            LEASE_NAME, f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        )
        self.store = store.fenced(self.fence)
        self.var_dir = var_dir
        self.ray_settings = ray
        self.settings = settings or SupervisorSettings.from_env()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancel_requested: dict[str, float] = {}
        self._launched_at: dict[str, float] = {}
        self._handles: dict[str, Any] = {}
        # Runs whose driver must be (re)launched once their placement group exists.
        self._relaunch: dict[str, int] = {}
        self._waiter = placement.Waiter(self.settings.placement)
        self._authority_checked_at = float("-inf")
        # Booking node changes reach running runs (orchestrator/runtime/resizing.py).
        self._resizer = Resizer(
            self.store,
            self._driver,
            ray_deliver(self.settings.rpc_timeout_s),
            self._place_added,
            locate=placement.node_ids,
        )
        self._resized_at = float("-inf")
        self._renewed_at = 0.0
        self.embedded = ray.address is None

    # -- RunRuntime -----------------------------------------------------------------------
    def start(self) -> None:
        self._connect()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        ray_cluster.private_var_dir(self.var_dir)
        os.environ.setdefault(launch.LAUNCH_KEY_ENV, str(self.var_dir / "launch.key"))
        launch.ensure_launch_key()
        settings = self.ray_settings
        if self.embedded and not settings.node_resources:
            # The embedded head is the one node of every booking registered now, plus
            # the catch-all mark for bookings added later (docs/placement.md).
            live = self.store.read(
                "SELECT booking_id, gpus_per_node FROM bookings WHERE state = 'active'", ()
            )
            marks = placement.embedded_marks([placement.booking_row(b) for b in live])
            settings = settings.model_copy(update={"node_resources": marks})
        ray_cluster.connect(self.var_dir, settings)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.store.release_lease(self.fence)  # a standby need not wait the lease out
        except Exception:
            log.warning("could not release the supervisor lease; it expires by itself")

    def submit(self, run_id: str) -> None:
        self._wake.set()

    def cancel(self, run_id: str) -> None:
        self._cancel_requested.setdefault(run_id, time.monotonic())
        handle = self._driver(run_id)
        if handle is not None:
            handle.cancel.remote()
        self._wake.set()

    def decide(self, run_id: str, proposal_id: str, decision: Decision) -> None:
        handle = self._driver(run_id)
        if handle is not None:
            handle.decide.remote(proposal_id, decision)
        self._wake.set()

    def cleanup(self, run_id: str) -> CleanupResult:
        """Remove the run's scratch space and checkpoints; the booking is not touched."""
        self.kill_run_actors(run_id)
        placement.release(run_id)
        removed: list[str] = []
        total = 0
        run = self.store.get_run(run_id)
        for path in (run_dir(self.var_dir, run_id), checkpoint_dir(run)):
            paths, size = remove_tree(path)
            removed += paths
            total += size
        return {"removed": removed, "bytes_removed": total}

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        store_down = False  # an outage is logged when it starts and ends, not every turn
        while not self._stop.is_set():
            try:
                if self._lead():
                    runs = self.store.runs_in_states(ACTIVE)
                    if self.enforce_authority(runs):
                        runs = self.store.runs_in_states(ACTIVE)
                    self._follow_bookings(runs)
                    for run in runs:
                        if self._stop.is_set() or not self._lead():
                            break
                        self._tick(run)
                if store_down:
                    log.warning("supervisor: the store answers again")
                    store_down = False
            except ItoError as e:
                if e.code == ErrorCode.store_unavailable:
                    if not store_down:
                        log.warning("supervisor waits for the store: %s", e.message)
                    store_down = True
                elif e.code != ErrorCode.lease_lost:
                    log.exception("supervisor tick failed")
                else:  # another replica leads now; the next turn stands by
                    log.warning("supervisor write refused: %s", e.message)
            except Exception:  # keep supervising; a bad run must not stop the others
                log.exception("supervisor tick failed")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def enforce_authority(self, runs: list[Row]) -> bool:
        """Stop every active run whose booking, account or term lapsed (checked at most
        every ``authority_check_interval_s``): it goes to ``cancelling`` with the lapse's
        code, and the cancel path tears its driver and fleet down. Returns whether any
        run was stopped."""
        now = time.monotonic()
        if now - self._authority_checked_at < self.settings.authority_check_interval_s:
            return False
        self._authority_checked_at = now
        stopped = False
        for run in runs:
            if run["state"] == RunState.cancelling:
                continue
            lapse = authority.lapsed(self.store, run)
            if lapse is None:
                continue
            try:
                self.store.transition(run["run_id"], RunState.cancelling, lapse.state_reason())
            except ItoError:  # it moved on meanwhile (finished, or cancelled by its tenant)
                continue
            log.warning("stopping run %s: %s", run["run_id"], lapse.code)
            self.cancel(run["run_id"])
            stopped = True
        return stopped

    def _follow_bookings(self, runs: list[Row]) -> None:
        """Send running runs their booking's node changes (and retry undelivered ones),
        at most every ``resize_check_interval_s``."""
        now = time.monotonic()
        if now - self._resized_at >= self.settings.resize_check_interval_s:
            self._resized_at = now
            self._resizer.follow(runs)

    def _place_added(
        self, run_id: str, change_id: int, booking: dict[str, Any], nodes: tuple[str, ...]
    ) -> PlacementFact | None:
        return placement.reserve_added(
            run_id,
            change_id,
            placement.booking_row(booking),
            nodes,
            self.settings.placement,
            embedded=self.embedded,
            booking_nodes=self.store.booking_nodes(booking["booking_id"]),
        )

    def _lead(self) -> bool:
        """Take or renew the lease (at most once a poll); on any change of leadership
        forget what this process knew, and start from the store as a restart does."""
        now = time.monotonic()
        if self.fence.token is not None and now - self._renewed_at < self.settings.poll_interval_s:
            return True
        before = self.fence.token
        token = self.store.acquire_lease(self.fence, self.settings.supervisor_lease_s)
        self._renewed_at = now
        if token != before:
            self._forget()
            if token is None:
                log.warning("supervisor lease %s lost; standing by", before)
            else:
                log.info("supervising as leader (lease token %s)", token)
        return token is not None

    def _forget(self) -> None:
        self._cancel_requested.clear()
        self._launched_at.clear()
        self._handles.clear()
        self._relaunch.clear()
        self._waiter = placement.Waiter(self.settings.placement)

    def _tick(self, run: Row) -> None:
        run_id, state = run["run_id"], RunState(run["state"])
        if state == RunState.accepted:
            self.store.transition(run_id, RunState.starting, "waiting for the booking's nodes")
            self._place_and_launch(run, attempt=1)
            return
        handle = self._driver(run_id)
        if handle is None:
            attempt = self._relaunch.get(run_id)
            if attempt is None and state == RunState.starting and run_id not in self._launched_at:
                attempt = driver_attempts(self.store, run_id)  # e.g. after an API restart
            if attempt is not None and state != RunState.cancelling:
                self._place_and_launch(self.store.get_run(run_id), attempt=attempt)
            else:
                self._on_driver_gone(run, state)
            return
        if state == RunState.cancelling:
            requested = self._cancel_requested.setdefault(run_id, time.monotonic())
            handle.cancel.remote()
            if time.monotonic() - requested > self.settings.cancel_grace_s:
                self._pull(run_id, handle)
                self.kill_run_actors(run_id)
                self._finish(run_id, RunState.cancelled, "cancelled (forced after grace period)")
                return
        import ray

        try:
            reply = self._pull(run_id, handle)
        except ray.exceptions.GetTimeoutError:
            return
        except ray.exceptions.RayActorError:
            self._handles.pop(run_id, None)
            self._on_driver_gone(run, state, seen_dead=True)
            return
        self._advance(run, reply)

    def _pull(self, run_id: str, handle: Any) -> DriverPoll:
        """Pull and persist every buffered event; the next poll acknowledges them."""
        import ray

        while True:
            after = self.store.max_seq(run_id)
            reply: DriverPoll = ray.get(
                handle.poll.remote(after), timeout=self.settings.rpc_timeout_s
            )
            if reply["events"]:
                self.store.ingest_events(run_id, reply["events"])
            if not reply.get("more"):
                return reply

    def _advance(self, run: Row, reply: DriverPoll) -> None:
        run_id, state = run["run_id"], RunState(run["state"])
        driver_state = reply["state"]
        if driver_state in ("succeeded", "failed", "cancelled"):
            target = {
                "succeeded": RunState.succeeded,
                "failed": RunState.failed,
                "cancelled": RunState.cancelled,
            }[driver_state]
            if state == RunState.cancelling and target != RunState.cancelled:
                target = RunState.cancelled
            reason = reply.get("reason") or driver_state
            if reply.get("error_code") and target == RunState.failed:
                reason = f"{reply['error_code']}: {reason}"
            self.kill_run_actors(run_id)
            self._finish(run_id, target, reason)
            return
        if state == RunState.starting and driver_state == "running":
            self.store.transition(run_id, RunState.running, "driver running")
            state = RunState.running
        pending = any(p["status"] == "pending" for p in self.store.list_proposals(run_id))
        if state == RunState.running and pending:
            self.store.transition(
                run_id, RunState.awaiting_approval, "a proposal awaits a human decision"
            )
        elif state == RunState.awaiting_approval and not pending:
            self.store.transition(run_id, RunState.running, "proposal decided")

    def _finish(self, run_id: str, target: RunState, reason: str) -> None:
        row = self.store.get_run(run_id)
        current = RunState(row["state"])
        if current in TERMINAL:
            return
        if current == RunState.cancelling and authority.stop_code(row["state_reason"]):
            # A stop that came with a code (a lapsed booking, an operator) keeps it.
            reason = f"{row['state_reason']}; {reason}"
        if (
            current in (RunState.awaiting_approval, RunState.paused_capacity)
            and target == RunState.succeeded
        ):
            self.store.transition(run_id, RunState.running, "proposal decided")
        self.store.transition(run_id, target, reason)
        self._cancel_requested.pop(run_id, None)
        self._launched_at.pop(run_id, None)
        self._handles.pop(run_id, None)
        self._relaunch.pop(run_id, None)
        self._waiter.done(run_id)
        try:
            placement.release(run_id)
        except Exception:  # Ray unreachable: the group goes with the cluster
            log.warning("could not remove the placement group of run %s", run_id)

    # -- drivers --------------------------------------------------------------------------
    def _driver(self, run_id: str) -> Any | None:
        handle = self._handles.get(run_id)
        if handle is None:
            handle = find_driver(run_id)
            if handle is not None:
                self._handles[run_id] = handle
        return handle

    def _place_and_launch(self, run: Row, *, attempt: int) -> None:
        """Launch the driver once the run's placement group holds the booking's nodes;
        until then say why the run waits, and fail it with a code after the wait."""
        run_id = run["run_id"]
        booking = placement.booking_row(
            self.store.booking(run["booking_id"])
            or {"booking_id": run["booking_id"], "node_count": 1}
        )
        self._relaunch[run_id] = attempt
        pg = placement.lookup(run_id)
        if pg is None:
            waiting = placement.unplaceable(
                booking, self.settings.placement, embedded=self.embedded
            )
            if waiting is None:
                pg = placement.reserve(
                    run_id,
                    booking,
                    self.settings.placement,
                    embedded=self.embedded,
                    nodes=self.store.booking_nodes(booking["booking_id"]),
                )
                if placement.state(pg) != "CREATED":  # Ray places it within a tick or two
                    self.store.set_state_reason(
                        run_id, f"reserving booking {booking['booking_id']}'s nodes"
                    )
                    return
        if pg is not None:
            if placement.state(pg) == "CREATED":
                fact = placement.fact(run_id, booking, pg)
                self._relaunch.pop(run_id, None)
                self._waiter.done(run_id)
                self._launch(run, attempt=attempt, placed=fact)
                self.store.set_state_reason(
                    run_id,
                    f"driver launched on booking {booking['booking_id']}'s nodes "
                    f"({fact.bundles} x {fact.bundle})",
                )
                return
            f = placement.fact(run_id, booking, pg)
            waiting = placement.diagnose(booking, f.resource, f.bundles)
        assert waiting is not None
        if self._waiter.expired(run_id):
            seconds = self.settings.placement.wait_timeout_s
            self._finish(
                run_id,
                RunState.failed,
                f"{waiting.code}: {waiting.reason}; gave up after {seconds:g}s",
            )
            return
        self.store.set_state_reason(run_id, waiting.reason)

    def _launch(self, run: Row, *, attempt: int, placed: PlacementFact | None = None) -> None:
        spec = launch_spec(
            self.store,
            run,
            var_dir=self.var_dir,
            settings=self.settings,
            attempt=attempt,
            placed=placed,
        )
        self._handles[spec.run_id] = start_driver(spec)
        self._launched_at[spec.run_id] = time.monotonic()

    def _on_driver_gone(self, run: Row, state: RunState, *, seen_dead: bool = False) -> None:
        """The run's driver is not there: relaunch it, or end the run. ``seen_dead``: a
        call to it failed (Ray knows it died), rather than its name not resolving."""
        run_id = run["run_id"]
        launched = self._launched_at.get(run_id)
        if (
            not seen_dead
            and launched is not None
            and time.monotonic() - launched < self.settings.rpc_timeout_s
        ):
            return  # just created; get_actor can lag the creation call
        if state == RunState.cancelling:
            self.kill_run_actors(run_id)
            self._finish(run_id, RunState.cancelled, "cancelled")
            return
        now = time.time()
        attempts = driver_attempts(self.store, run_id)
        seq = self.store.max_seq(run_id) + 1
        node_gone = node_lost(run_id)
        exhausted = attempts >= self.settings.max_driver_attempts
        lost = InterruptionEvent(
            interruption_kind="node_lost" if node_gone else "driver_lost",
            detected_at=now,
            # Recovered by the relaunch below; never, when this loss ends the run.
            recovered_at=None if node_gone or exhausted else now,
            detail=f"driver of attempt {attempts} gone" + (f"; {node_gone}" if node_gone else ""),
        )
        if exhausted:
            self.store.ingest_events(run_id, [{**lost.model_dump(mode="json"), "seq": seq}])
            self._finish(
                run_id,
                RunState.failed,
                f"{ErrorCode.driver_lost}: the run's driver is gone and "
                f"{attempts} launches were used",
            )
            return
        self.kill_run_actors(run_id)
        note = LogEvent(
            level="warning",
            stage="orchestrator",
            message=f"driver lost; relaunching (attempt {attempts + 1}), resuming "
            "from the newest complete checkpoint",
        )
        self.store.ingest_events(
            run_id,
            [
                {**lost.model_dump(mode="json"), "seq": seq},
                {**note.model_dump(mode="json"), "seq": seq + 1},
            ],
        )
        self._place_and_launch(self.store.get_run(run_id), attempt=attempts + 1)

    def kill_run_actors(self, run_id: str) -> list[str]:
        """Kill the run's driver and every actor named after the run."""
        killed = driver_lifecycle.kill_run_actors(run_id, self.settings.rpc_timeout_s)
        self._handles.pop(run_id, None)
        return killed
