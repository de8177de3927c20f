"""The rollout controller: admission, ordering, weight sync and worker recovery.

Request ids are consecutive; request ``k`` always asks for the same prompt with the
same seed, and groups are walked into batches in id order, so the batches do not
depend on which worker answered first. Staleness is bounded twice (AReaL):

- admission: request ``k`` would be trained at step
  ``s = V + (len(batch) + k - walk_id) // G`` or earlier (earlier ids either fill
  batches first or are dropped), so it goes to worker ``w`` only if
  ``s - version(w) <= eta``; the worker checks the same bound itself;
- the trainer refuses any walked group older than ``eta`` versions (regenerated),
  and the learner re-checks every group of a batch before its update (dropped);
  both count as ``stale_refused``.

A worker that dies mid-rollout loses its request (regenerated under the same id, so
never trained under a wrong version); Ray restarts it, the controller re-sends the
current weights and counts the interruption once the worker acknowledges them. Until
Ray sees the death, every call to the worker fails at once: those failures are one
loss, not many, and the re-send is paced (``RESYNC_RETRY_S``) and bounded by
``restart_timeout_s``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from stages.errors import ErrorCode, ItoError
from stages.post_training.admission import is_stale, is_uniform
from stages.post_training.pools import Handle, WorkerLost, WorkerPool
from stages.post_training.rollout import Refusal, RolloutGroup, RolloutRequest

if TYPE_CHECKING:
    from stages.post_training.weight_descriptors import PolicyWeights, SentWeights

MakeRequest = Callable[[int, int], RolloutRequest]  # (id, consume_step) -> request
# Pause between weight re-sends to a worker that is still down (each failed call
# returns at once, so without it the controller spins while Ray restarts the actor).
RESYNC_RETRY_S = 0.5


_T = TypeVar("_T")


class DynamicSampler:
    """DAPO dynamic sampling for one step: uniform-reward groups are dropped (and so
    refilled by more generation) until ``max_drops`` per step; after that they are
    kept (their advantage is zero)."""

    def __init__(self, enabled: bool, max_drops: int):
        self.enabled = enabled
        self.max_drops = max_drops
        self.dropped = 0

    def reset(self) -> None:
        self.dropped = 0

    def offer(self, rewards: list[float]) -> bool:
        if self.enabled and self.dropped < self.max_drops and is_uniform(rewards):
            self.dropped += 1
            return False
        return True


@dataclass
class FleetStats:
    started: float = field(default_factory=time.perf_counter)
    wait_s: float = 0.0
    samples: int = 0
    gen_s: float = 0.0
    groups_dropped: int = 0
    groups_accepted: int = 0
    stale_refused: int = 0
    worker_refused: int = 0
    interruptions: int = 0
    discarded_rollouts: int = 0
    missed_versions: int = 0  # syncs a worker could not fetch (it kept its version)
    sync_s: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)

    def summary(self, workers: int) -> dict[str, float]:
        wall = max(time.perf_counter() - self.started, 1e-9)
        walked = self.groups_dropped + self.groups_accepted
        st = self.staleness or [0]
        return {
            "rollout_samples_per_s": self.samples / wall,
            "trainer_idle_frac": min(1.0, self.wait_s / wall),
            "rollout_idle_frac": max(0.0, 1.0 - self.gen_s / (workers * wall)),
            "weight_sync_s": statistics.median(self.sync_s) if self.sync_s else 0.0,
            "sync_s_median": statistics.median(self.sync_s) if self.sync_s else 0.0,
            "staleness_min": float(min(st)),
            "staleness_mean": float(statistics.fmean(st)),
            "staleness_max": float(max(st)),
            "drop_rate": self.groups_dropped / walked if walked else 0.0,
            "stale_refused": float(self.stale_refused),
            "rollout_interruptions": float(self.interruptions),
            "weight_sync_missed": float(self.missed_versions),
        }


class RolloutController:
    def __init__(
        self,
        pool: WorkerPool,
        make_request: MakeRequest,
        *,
        groups_per_step: int,
        max_staleness: int,
        sampler: DynamicSampler,
        rollout_timeout_s: float,
        restart_timeout_s: float,
        max_worker_losses: int = 8,
        on_interruption: Callable[[int, float, float, str], None] | None = None,
    ):
        self.pool = pool
        self.make_request = make_request
        self.G = groups_per_step
        self.eta = max_staleness
        self.sampler = sampler
        self.rollout_timeout_s = rollout_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.max_worker_losses = max_worker_losses
        self.on_interruption = on_interruption
        self.V = 0
        self.next_id = 0
        self.walk_id = 0
        self.batch: list[RolloutGroup] = []
        self.walked: list[RolloutGroup] = []  # every group walked this step (for rewards)
        self.resolved: dict[int, RolloutGroup] = {}
        self.retry: list[int] = []
        self.inflight: dict[int, tuple[int, Handle]] = {}  # worker -> (request id, handle)
        self.syncing: dict[int, tuple[Handle, float, float | None]] = {}  # w -> (h, t0, lost_at)
        self.known_version = [-1] * pool.size
        self.stats = FleetStats()
        self._weights: SentWeights | None = None  # None: nothing published yet
        self._put_s = 0.0
        self._sync_load: list[float] = []
        self._losses = 0
        self._resend_at: dict[int, tuple[float, float]] = {}  # w -> (due, lost_at)
        self._training = False

    # -- resume ----------------------------------------------------------------------
    def resume_state(self) -> dict[str, int]:
        """The admission state a resume needs: the version and the walk cursor (every
        id below it went into a trained batch or was dropped)."""
        return {"version": self.V, "walk_id": self.walk_id}

    def restore(self, saved: dict[str, int]) -> None:
        """Before the first publish: ids from the cursor on are generated again."""
        self.V = int(saved["version"])
        self.walk_id = self.next_id = int(saved["walk_id"])
        self.retry, self.resolved = [], {}

    # -- weights ---------------------------------------------------------------------
    def publish(self, version: int, weights: PolicyWeights) -> None:
        """Send ``weights`` as ``version`` to every worker (queued behind its rollout):
        what the learner's rank 0 published (a ``PublishedVersion``: only its
        descriptor is forwarded), the base folder (``BaseWeights``), or an in-process
        learner's state dict, which the pool puts first."""
        from stages.post_training.weight_descriptors import BaseWeights, PublishedVersion

        t0 = time.perf_counter()
        if isinstance(weights, PublishedVersion):
            self._weights, self._put_s = weights.weights, weights.put_s  # put on the rank
        elif isinstance(weights, BaseWeights):
            self._weights, self._put_s = weights, 0.0
        else:
            self._weights = self.pool.put_weights(weights)
            self._put_s = time.perf_counter() - t0
        self._sync_load = []
        self.V = version
        for w in range(self.pool.size):
            if w in self._resend_at:  # still down: it gets V when it is re-sent
                continue
            prev = self.syncing.get(w)  # a restart in progress stays one outage
            self._send(w, lost_at=prev[2] if prev is not None else None)

    def _send(self, w: int, lost_at: float | None) -> None:
        self.syncing[w] = (self.pool.sync(w, self.V, self._weights), time.time(), lost_at)
        self.known_version[w] = self.V

    # -- admission -------------------------------------------------------------------
    def expected_step(self, k: int) -> int:
        # While the trainer trains, the next batch is trained at V + 1 at the earliest.
        base = self.V + (1 if self._training else 0)
        return base + (len(self.batch) + k - self.walk_id) // self.G

    def _resend_due(self) -> None:
        now = time.monotonic()
        for w, (due, lost_at) in list(self._resend_at.items()):
            if due <= now:
                del self._resend_at[w]
                self._send(w, lost_at=lost_at)

    def _admit(self) -> None:
        self._resend_due()
        busy = set(self.inflight)
        for w in range(self.pool.size):
            if (
                w in busy
                or w in self._resend_at
                or (w in self.syncing and self.syncing[w][2] is not None)
            ):
                continue  # busy, or restarting: wait for its re-sync
            k = self.retry[0] if self.retry else self.next_id
            s = self.expected_step(k)
            if s - self.known_version[w] > self.eta:
                continue
            if self.retry:
                self.retry.pop(0)
            else:
                self.next_id += 1
            self.inflight[w] = (k, self.pool.submit(w, self.make_request(k, s)))

    # -- the loop --------------------------------------------------------------------
    def next_batch(self) -> tuple[list[RolloutGroup], list[RolloutGroup]]:
        """Block until ``G`` groups are admitted for step ``V``; returns (batch, every
        group walked for this step, dropped ones included)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.rollout_timeout_s
        while len(self.batch) < self.G:
            self._admit()
            handles = [h for _, h in self.inflight.values()] + [
                h for h, _, _ in self.syncing.values()
            ]
            ready = self.pool.wait(handles, timeout_s=self._wait_s(deadline))
            if not ready and time.monotonic() >= deadline:
                raise ItoError(
                    ErrorCode.rollout_fleet_failed,
                    f"no rollout finished within {self.rollout_timeout_s:.0f}s",
                )
            self._collect(ready)
            self._walk()
        self.stats.wait_s += time.perf_counter() - t0
        batch, walked = self.batch, self.walked
        self.batch, self.walked = [], []
        self.sampler.reset()
        return batch, walked

    def _wait_s(self, deadline: float) -> float:
        """How long one wait may block: until the deadline or the next due re-send."""
        until = min([deadline, *(due for due, _ in self._resend_at.values())])
        return max(0.0, until - time.monotonic())

    def pump_while(self, train: Callable[[], _T]) -> _T:
        """Run ``train()`` (the optimizer step) while the fleet keeps generating:
        requests are admitted against version V + 1 and results collected, but not
        walked (a walk checks staleness against the version that trains on them)."""
        import threading

        done = threading.Event()
        error: list[BaseException] = []

        def pump() -> None:
            try:
                while not done.is_set():
                    self._admit()
                    handles = [h for _, h in self.inflight.values()] + [
                        h for h, _, _ in self.syncing.values()
                    ]
                    self._collect(self.pool.wait(handles, timeout_s=0.02))
            except BaseException as e:  # surfaced to the caller below
                error.append(e)

        self._training = True
        t = threading.Thread(target=pump, name="rollout-pump", daemon=True)
        t.start()
        try:
            return train()
        finally:
            done.set()
            t.join()
            self._training = False
            if error:
                raise error[0]

    def _collect(self, ready: list[Handle]) -> None:
        ready_ids = {id(h) for h in ready}
        for w, (h, t_sent, lost_at) in list(self.syncing.items()):
            if id(h) in ready_ids:
                self._on_synced(w, h, t_sent, lost_at)
        for w, (k, h) in list(self.inflight.items()):
            if id(h) in ready_ids:
                del self.inflight[w]
                self._on_result(w, k, h)

    def _on_synced(self, w: int, h: Handle, t_sent: float, lost_at: float | None) -> None:
        try:
            ack = self.pool.result(w, h)
        except WorkerLost as e:
            self._lost(w, e)
            return
        assert isinstance(ack, dict)  # a sync's handle: its SyncAck
        del self.syncing[w]
        # A version the worker could not fetch leaves it at its own: admit against that.
        self.known_version[w] = int(ack["version"])
        self.stats.missed_versions += int("missed" in ack)
        self._sync_load.append(float(ack["load_s"]))
        if len(self._sync_load) == self.pool.size:
            self.stats.sync_s.append(self._put_s + max(self._sync_load))
        if lost_at is not None:
            self.stats.interruptions += 1
            if self.on_interruption is not None:
                self.on_interruption(
                    w,
                    lost_at,
                    time.time(),
                    f"rollout worker restarted and re-synced to version {self.V}",
                )

    def _on_result(self, w: int, k: int, h: Handle) -> None:
        try:
            out = self.pool.result(w, h)
        except WorkerLost as e:
            self.stats.discarded_rollouts += 1
            self._requeue(k)
            self._lost(w, e)
            return
        if isinstance(out, Refusal):
            self.stats.worker_refused += 1
            self._requeue(k)
            if out.reason == "no weights" and w not in self.syncing and w not in self._resend_at:
                # Restarted while idle: its death went unseen until now.
                self._send(w, lost_at=time.time())
            return
        assert isinstance(out, RolloutGroup)  # a rollout's handle: its group or refusal
        self.stats.gen_s += out.gen_s
        self.stats.samples += len(out.rewards)
        self.resolved[k] = out

    def _requeue(self, k: int) -> None:
        self.retry.append(k)
        self.retry.sort()

    def _lost(self, w: int, e: WorkerLost) -> None:
        prev = self.syncing.get(w)
        outage = prev[2] if prev is not None else None  # set: the same death, seen again
        if outage is None:
            self._losses += 1
            if self._losses > self.max_worker_losses:
                raise ItoError(
                    ErrorCode.rollout_fleet_failed,
                    f"rollout workers lost {self._losses} times: {e.detail}",
                )
        elif time.time() - outage > self.restart_timeout_s:
            raise ItoError(
                ErrorCode.rollout_fleet_failed,
                f"rollout worker {w} not back within {self.restart_timeout_s:.0f}s: {e.detail}",
            )
        if w in self.inflight:
            k, _ = self.inflight.pop(w)
            self.stats.discarded_rollouts += 1
            self._requeue(k)
        self.syncing.pop(w, None)
        lost_at = outage if outage is not None else time.time()
        if outage is None:
            self._send(w, lost_at=lost_at)  # Ray queues it once it sees the death
        else:  # still down: try again shortly
            self._resend_at[w] = (time.monotonic() + RESYNC_RETRY_S, lost_at)

    def _walk(self) -> None:
        while len(self.batch) < self.G and self.walk_id in self.resolved:
            g = self.resolved.pop(self.walk_id)
            if is_stale(self.V, g.version, self.eta):
                self.stats.stale_refused += 1
                self._requeue(self.walk_id)
                return
            self.walked.append(g)
            if self.sampler.offer(g.rewards):
                self.batch.append(g)
                self.stats.groups_accepted += 1
                self.stats.staleness.append(self.V - g.version)
            else:
                self.stats.groups_dropped += 1
            self.walk_id += 1

    def drain_syncs(self, timeout_s: float) -> None:
        """Wait for outstanding weight syncs (e.g. before reading worker versions)."""
        deadline = time.monotonic() + timeout_s
        while (self.syncing or self._resend_at) and time.monotonic() < deadline:
            self._resend_due()
            handles = [h for h, _, _ in self.syncing.values()] + [
                h for _, h in self.inflight.values()
            ]
            self._collect(self.pool.wait(handles, self._wait_s(deadline)))
