"""Where rollout workers live: Ray actors (the fleet) or threads (tests, the
synchronous reference). Both run each worker's calls one at a time, in the order
they were submitted, so a weight sync queued behind a rollout applies before the
next rollout starts."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

from stages.post_training.rollout import (
    PromptEncoding,
    Refusal,
    RolloutGroup,
    RolloutRequest,
    RolloutWorker,
    WorkerReply,
    WorkerSpec,
    rollout_name,
)
from stages.post_training.weight_descriptors import (
    ObjectStoreWeights,
    SentWeights,
    StateDict,
    WeightSync,
    state_bytes,
)
from stages.post_training.weight_sync import CollectiveSender

if TYPE_CHECKING:
    from ray import ObjectRef

# Defaults of the collective path's named settings (RLVRConfig carries the run's).
BUCKET_BYTES = 64 << 20
SYNC_TIMEOUT_S = 300.0


class SenderArgs(TypedDict, total=False):
    """A pool's settings for its end of the collective path (``CollectiveSender``)."""

    workers: int
    host: str
    device: str
    bucket_bytes: int
    timeout_s: float


def make_sender(args: SenderArgs, sync_key: bytes | None) -> CollectiveSender:
    """An in-process learner's end of the collective path (it needs the run's key)."""
    if sync_key is None:
        raise ValueError("the collective weight path needs the run's weight-sync key")
    return CollectiveSender(key=sync_key, **args)


class WorkerLost(Exception):
    def __init__(self, worker: int, detail: str):
        super().__init__(f"rollout worker {worker} lost: {detail}")
        self.worker = worker
        self.detail = detail


# A call in flight on one worker, as its pool made it (``LocalPool``: a ``Future``;
# ``RayPool``: an ``ObjectRef``). The controller only waits on it and hands it back to
# the pool that made it, which reads it as its own kind.
Handle = object


class WorkerPool(Protocol):
    size: int

    def submit(self, w: int, req: RolloutRequest) -> Handle: ...
    def sync(self, w: int, version: int, weights: SentWeights | None) -> Handle: ...
    def put_weights(self, state: StateDict) -> SentWeights: ...
    def wait(self, handles: list[Handle], timeout_s: float) -> list[Handle]: ...
    def result(self, w: int, handle: Handle) -> WorkerReply: ...
    def versions(self, timeout_s: float) -> list[int]: ...
    def wait_started(self, timeout_s: float) -> None: ...
    def encode_prompts(self, rows: list[dict[str, Any]]) -> Callable[[float], PromptEncoding]: ...
    def close(self) -> None: ...


# The longest a wait on nothing in flight blocks: the pump re-checks admission this often.
IDLE_WAIT_S = 0.01


def _nothing_in_flight(timeout_s: float) -> list[Handle]:
    """A wait with no handle still waits (``cf.wait([])`` returns at once): the pump
    that loops on it would otherwise spin and starve in-process workers of the GIL."""
    time.sleep(min(timeout_s, IDLE_WAIT_S))
    return []


class LocalPool:
    """In-process workers, one single-thread executor each (FIFO per worker).

    In-process workers share torch's global RNG, which generation seeds per request:
    their rollouts run one at a time so a seed means the same samples as in a
    process of its own."""

    def __init__(
        self,
        workers: list[RolloutWorker],
        *,
        weight_sync: WeightSync = "object_store",
        bucket_bytes: int = BUCKET_BYTES,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        sync_key: bytes | None = None,
    ):
        """``sync_key``: the run's weight-sync key, for this process's end of the
        collective path (the workers were given it when they were made)."""
        self.workers = workers
        self.size = len(workers)
        self._ex = [cf.ThreadPoolExecutor(max_workers=1) for _ in workers]
        self._rng_lock = threading.Lock()
        self.weight_sync = weight_sync
        # This process's end of the collective, made on the first state dict it is
        # given (an in-process learner); the engine's rank 0 runs its own.
        self._sender: CollectiveSender | None = None
        self._sync_key = sync_key
        self._sender_args: SenderArgs = {
            "workers": self.size,
            "host": "127.0.0.1",  # in-process workers: loopback, never a wildcard
            "device": "cpu",
            "bucket_bytes": bucket_bytes,
            "timeout_s": sync_timeout_s,
        }

    def _generate(self, w: int, req: RolloutRequest) -> WorkerReply:
        with self._rng_lock:
            return self.workers[w].generate(req)

    def _set_weights(self, w: int, version: int, weights: SentWeights | None) -> WorkerReply:
        return self.workers[w].set_weights(version, weights)

    def submit(self, w: int, req: RolloutRequest) -> Handle:
        return self._ex[w].submit(self._generate, w, req)

    def put_weights(self, state: StateDict) -> SentWeights:
        if self.weight_sync == "collective":
            return self._collective().put(state)
        # The trainer changes its tensors in place on the next step: hand over a copy.
        return {k: v.detach().clone() for k, v in state.items()}

    def _collective(self) -> CollectiveSender:
        if self._sender is None:
            self._sender = make_sender(self._sender_args, self._sync_key)
        return self._sender

    def digests(self, timeout_s: float) -> list[str]:
        futs = [ex.submit(wk.weights_digest) for ex, wk in zip(self._ex, self.workers, strict=True)]
        return [str(f.result(timeout=timeout_s)) for f in futs]

    def sync(self, w: int, version: int, weights: SentWeights | None) -> Handle:
        return self._ex[w].submit(self._set_weights, w, version, weights)

    def wait(self, handles: list[Handle], timeout_s: float) -> list[Handle]:
        if not handles:
            return _nothing_in_flight(timeout_s)
        futures = cast("list[cf.Future[WorkerReply]]", handles)  # this pool's own
        done, _ = cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        return list(done)

    def result(self, w: int, handle: Handle) -> WorkerReply:
        try:
            return cast("cf.Future[WorkerReply]", handle).result()
        except Exception as e:
            raise WorkerLost(w, f"{type(e).__name__}: {e}") from e

    def versions(self, timeout_s: float) -> list[int]:
        futs = [ex.submit(wk.identity) for ex, wk in zip(self._ex, self.workers, strict=True)]
        return [int(f.result(timeout=timeout_s)["version"]) for f in futs]

    def wait_started(self, timeout_s: float) -> None:
        """In-process workers are up once the pool is."""

    def encode_prompts(self, rows: list[dict[str, Any]]) -> Callable[[float], PromptEncoding]:
        done = self._ex[0].submit(self.workers[0].encode_prompts, rows)
        return lambda timeout_s: done.result(timeout=timeout_s)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        for ex in self._ex:
            ex.shutdown(wait=True, cancel_futures=True)


# CPU share of one rollout actor on the testbed; a GPU each on cuda.
ROLLOUT_NUM_CPUS = 0.5


class RayPool:
    """Rollout workers as named Ray actors that Ray restarts when they die."""

    def __init__(
        self,
        run_id: str,
        specs: list[WorkerSpec],
        *,
        device: str = "cpu",
        max_restarts: int = 3,
        namespace: str | None = None,
        placement: Mapping[str, Any] | None = None,
        worker_cls: type[RolloutWorker] | None = None,
        weight_sync: WeightSync = "object_store",
        bucket_bytes: int = BUCKET_BYTES,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        sync_key: bytes | None = None,
    ):
        """``sync_key``: the run's weight-sync key; each worker gets it as an actor
        argument (the only way it reaches them)."""
        import ray

        self.size = len(specs)
        self.weight_sync = weight_sync
        # What each worker asks of the run's reservation, for the error when one never starts.
        self._ask = f"{ROLLOUT_NUM_CPUS} CPU" + (" and a GPU" if device == "cuda" else "")
        # An in-process learner's end of the collective (rank 0, made on its first
        # state dict; workers reach its listener at this node's cluster address). The
        # engine's publishing rank runs its own and this one is never made.
        self._sender: CollectiveSender | None = None
        self._sync_key = sync_key
        self._sender_args: SenderArgs = {
            "workers": self.size,
            "device": device,
            "bucket_bytes": bucket_bytes,
            "timeout_s": sync_timeout_s,
        }
        # worker_cls: a RolloutWorker subclass (another generation backend).
        cls: Any = ray.remote(worker_cls or RolloutWorker)
        self.actors: list[Any] = [
            cls.options(
                name=rollout_name(run_id, s.index),
                namespace=namespace,
                num_cpus=ROLLOUT_NUM_CPUS,
                num_gpus=1 if device == "cuda" else 0,
                max_restarts=max_restarts,
                max_task_retries=0,
                max_concurrency=1,
                # Inside the run's placement group on its booking's nodes (stages.placement).
                **(placement or {}),
            ).remote(s, sync_key)
            for s in specs
        ]

    def submit(self, w: int, req: RolloutRequest) -> Handle:
        return self.actors[w].generate.remote(req)

    def put_weights(self, state: StateDict) -> SentWeights:
        import ray

        if self.weight_sync == "collective":
            if self._sender is None:
                self._sender = make_sender(self._sender_args, self._sync_key)
            return self._sender.put(state)
        cpu = {k: v.detach().cpu() for k, v in state.items()}
        return ObjectStoreWeights(ref=ray.put(cpu), bytes=state_bytes(cpu))

    def digests(self, timeout_s: float) -> list[str]:
        import ray

        refs = [a.weights_digest.remote() for a in self.actors]
        return [str(d) for d in ray.get(refs, timeout=timeout_s)]

    def sync(self, w: int, version: int, weights: SentWeights | None) -> Handle:
        # A descriptor, never a top-level ObjectRef: its nested ref reaches the worker
        # unresolved and the worker fetches it itself (nothing passes through here).
        return self.actors[w].set_weights.remote(version, weights)

    def wait(self, handles: list[Handle], timeout_s: float) -> list[Handle]:
        import ray

        if not handles:
            return _nothing_in_flight(timeout_s)
        refs = cast("list[ObjectRef[WorkerReply]]", handles)  # this pool's own
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        return list(ready)

    def result(self, w: int, handle: Handle) -> WorkerReply:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return ray.get(cast("ObjectRef[WorkerReply]", handle))
        except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
            raise WorkerLost(w, type(e).__name__) from e

    def versions(self, timeout_s: float) -> list[int]:
        import ray

        return [
            int(i["version"])
            for i in ray.get([a.identity.remote() for a in self.actors], timeout=timeout_s)
        ]

    def wait_started(self, timeout_s: float) -> None:
        """Every worker's process is up (its model may still be loading). One that is
        not within ``timeout_s`` fails the fleet (``rollout_fleet_failed``) instead of
        leaving RLVR to wait out its rollout timeout: most often Ray could not place it,
        the run's reservation holding no room beside the trainer's ranks."""
        import ray

        from stages.errors import ErrorCode, ItoError

        refs = [a.started_at.remote() for a in self.actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            missing = [w for w, ref in enumerate(refs) if ref in pending]
            raise ItoError(
                ErrorCode.rollout_fleet_failed,
                f"rollout worker(s) {missing} of {self.size} not started within "
                f"{timeout_s:.0f}s: each asks {self._ask} of the run's reservation beside "
                "the trainer's ranks and standbys, and Ray places none where that is not free",
            )

    def encode_prompts(self, rows: list[dict[str, Any]]) -> Callable[[float], PromptEncoding]:
        """Worker 0's encoding, asked for now (it answers once it is up); the returned
        call collects it, waiting at most its timeout."""
        import ray
        from ray.exceptions import RayActorError

        ref = self.actors[0].encode_prompts.remote(rows)

        def collect(timeout_s: float) -> PromptEncoding:
            try:
                return PromptEncoding.model_validate(ray.get(ref, timeout=timeout_s))
            except RayActorError:  # worker 0 died first: ask the one Ray restarted
                again = self.actors[0].encode_prompts.remote(rows)
                return PromptEncoding.model_validate(ray.get(again, timeout=timeout_s))

        return collect

    def identities(self, timeout_s: float) -> list[dict[str, int]]:
        import ray

        return list(ray.get([a.identity.remote() for a in self.actors], timeout=timeout_s))

    def close(self) -> None:
        import ray

        if self._sender is not None:
            self._sender.close()
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                continue


__all__ = ["LocalPool", "RayPool", "Refusal", "RolloutGroup", "WorkerLost", "WorkerPool"]
