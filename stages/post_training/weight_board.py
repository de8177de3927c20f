"""How the learner's rank 0 hands each policy version to the driver without the
driver ever holding the tensors.

The driver coordinates; the ranks hold the weights. After each committed step the
publishing rank (rank 0 of the lowest live replica group) puts the full state into
Ray's object store from its own process, or packs it for the collective broadcast it
runs itself (``weight_sync``), and offers the board a
:class:`~stages.post_training.weight_descriptors.PublishedVersion`: a descriptor, the loss
and the put time. The board is a small actor of the driver's (no CPU reserved); the
driver takes version ``k`` from it and forwards the descriptor to every worker's
``set_weights``. What crosses the driver is a few hundred bytes per version.

The board accepts exactly the versions the driver will take, one publisher each:
from ``first_wanted`` on (a resume's checkpoint step; version 0 is the base folder
every worker loads itself), above the newest taken, and not one already offered.
That matters on the collective path, where an accepted offer is a broadcast every
worker must join: a version offered twice (a healed group, a restored rank
re-committing steps) is refused and never broadcast.

Ownership: an object put by rank 0 is owned by rank 0 and lost if that process dies
(a heal, a node loss). A worker that cannot fetch a version keeps the one it has and
says so; the controller then treats it as that version (its staleness bound holds:
the worker's own admission check refuses what it may not generate) and the next
version, published by the healed rank, replaces it. So that the last version of a
run is not lost when the engine's ranks exit, rank 0 waits at the last step until the
driver has delivered it to the fleet (``release``), at most ``timeout_s``.

A process also offers the version it starts from (its first batch): after a driver
relaunch, the fleet's first version is the restored checkpoint's, and only the
ranks have it.

On the collective path the board also hands the publishing rank the run's weight-sync
key (``sync_key``), which the driver gave it as an actor argument: the rank's
listener admits only workers that prove it (``weight_sync``). It travels only through
Ray (token-authenticated), never an environment or a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from stages.errors import ErrorCode, ItoError
from stages.post_training.weight_descriptors import (
    ObjectStoreWeights,
    PublishedVersion,
    state_bytes,
)
from stages.post_training.weight_sync import CollectiveSender

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from stages.trainer.config import GRPOSettings

# Offered versions not yet taken that the board keeps (the driver takes them in
# order and the ranks are at most one step ahead of it; a run with no driver taking,
# e.g. the learner benchmark, must not pile them up in the object store).
BOARD_KEEP = 2
# How long one driver call to the board blocks before it checks the engine again.
TAKE_CHUNK_S = 1.0
# Bound on a rank's small calls to the board (offer, wants): an actor of the driver.
BOARD_CALL_TIMEOUT_S = 60.0


def board_name(run_id: str, token: str) -> str:
    """One board per driver incarnation (a relaunch gets a new one)."""
    return f"run-{run_id}-rlvr-weights-{token}"


class WeightBoard:
    """The driver's mailbox of published versions (a Ray async actor; see the module
    docstring for what it accepts)."""

    def __init__(self, first_wanted: int, sync_key: bytes | None = None):
        self._changed = asyncio.Condition()
        self._sync_key = sync_key
        self._begin(first_wanted)

    def _begin(self, first_wanted: int) -> None:
        self.first_wanted = first_wanted
        self.taken = first_wanted - 1
        self.released = first_wanted - 1
        self.held: dict[int, PublishedVersion] = {}
        self.offers = 0  # accepted

    async def begin_at(self, first_wanted: int) -> None:
        """Accept versions from ``first_wanted`` on (a board started ahead of its run,
        told where the run resumes before any rank offers a version)."""
        if self.offers:
            raise RuntimeError("the board has accepted versions already")
        self._begin(first_wanted)

    def _wants(self, version: int) -> bool:
        return version >= self.first_wanted and version > self.taken and version not in self.held

    async def wants(self, version: int) -> bool:
        return self._wants(version)

    async def offer(self, published: PublishedVersion) -> bool:
        v = published.version
        if not self._wants(v):
            return False
        self.held[v] = published
        self.offers += 1
        for old in sorted(self.held)[:-BOARD_KEEP]:
            del self.held[old]
        async with self._changed:
            self._changed.notify_all()
        return True

    async def take(self, version: int, timeout_s: float) -> PublishedVersion | None:
        """Version ``version`` once offered (None after ``timeout_s``); older ones go."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: version in self.held), timeout_s
                )
            except TimeoutError:
                return None
        published = self.held.pop(version)
        self.taken = max(self.taken, version)
        for old in [v for v in self.held if v < version]:
            del self.held[old]
        return published

    async def release(self, version: int) -> None:
        """The driver delivered ``version`` to the fleet (its publisher may exit)."""
        self.released = max(self.released, version)
        async with self._changed:
            self._changed.notify_all()

    async def wait_released(self, version: int, timeout_s: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.released >= version), timeout_s
                )
            except TimeoutError:
                return False
        return True

    async def sync_key(self) -> bytes | None:
        """The run's weight-sync key, for the publishing rank's listener."""
        return self._sync_key

    async def stats(self) -> dict[str, int]:
        return {"taken": self.taken, "released": self.released, "offers": self.offers}


def start_board(
    name: str,
    first_wanted: int,
    placement: dict[str, Any] | None = None,
    sync_key: bytes | None = None,
) -> Any:
    """``sync_key``: the run's weight-sync key (the collective path needs it)."""
    import ray

    cls: Any = ray.remote(WeightBoard)
    return cls.options(name=name, num_cpus=0, max_restarts=0, **(placement or {})).remote(
        first_wanted, sync_key
    )


def take(
    board: Any, version: int, timeout_s: float, stopped: Callable[[], bool]
) -> PublishedVersion:
    """The driver's side: wait for ``version`` on the board while ``stopped()`` is
    false; raises ``TimeoutError`` after ``timeout_s``, ``InterruptedError`` when
    stopped."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(version)
        chunk = min(TAKE_CHUNK_S, left)
        got = ray.get(board.take.remote(version, chunk), timeout=chunk + BOARD_CALL_TIMEOUT_S)
        if got is not None:
            return got  # type: ignore[no-any-return]
        if stopped():
            raise InterruptedError(version)


class RankPublisher:
    """The publishing rank's side (one per process; see the module docstring)."""

    def __init__(self, settings: GRPOSettings, device: str):
        self.s = settings
        self.device = device
        self._board: Any = None
        self._sender: CollectiveSender | None = None

    @property
    def enabled(self) -> bool:
        return self.s.weights_board is not None and self.s.fleet_workers > 0

    def board(self) -> Any:
        if self._board is None:
            import ray

            assert self.s.weights_board is not None  # a rank publishes only when enabled
            self._board = ray.get_actor(self.s.weights_board)
        return self._board

    def wants(self, version: int) -> bool:
        import ray

        return bool(ray.get(self.board().wants.remote(version), timeout=BOARD_CALL_TIMEOUT_S))

    def publish(
        self, version: int, state: dict[str, torch.Tensor], loss: float, *, last: bool
    ) -> bool:
        """Offer ``state`` (this rank's full tensors) as ``version``; True if the board
        took the offer. ``last``: wait until the driver delivered it."""
        import ray

        t0 = time.perf_counter()
        board = self.board()
        if self.s.weight_sync == "collective":
            sender = self._collective()
            desc = sender.describe(state)
            flats = sender.pack(state, desc)
            offer = PublishedVersion(version, desc, loss, time.perf_counter() - t0)
            accepted = bool(ray.get(board.offer.remote(offer), timeout=BOARD_CALL_TIMEOUT_S))
            if accepted:
                sender.send(desc, flats)
        else:
            cpu = {k: v.detach().cpu() for k, v in state.items()}
            ref = ray.put(cpu)
            weights = ObjectStoreWeights(ref=ref, bytes=state_bytes(cpu))
            offer = PublishedVersion(version, weights, loss, time.perf_counter() - t0)
            accepted = bool(ray.get(board.offer.remote(offer), timeout=BOARD_CALL_TIMEOUT_S))
            del ref, weights, offer  # the board (and then the workers) borrow it
        if accepted and last:
            # A driver that is gone has nobody to deliver to: go on.
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(
                    board.wait_released.remote(version, self.s.weight_sync_timeout_s),
                    timeout=self.s.weight_sync_timeout_s + BOARD_CALL_TIMEOUT_S,
                )
        return accepted

    def _collective(self) -> CollectiveSender:
        if self._sender is None:
            import ray

            key = ray.get(self.board().sync_key.remote(), timeout=BOARD_CALL_TIMEOUT_S)
            if key is None:
                raise ItoError(
                    ErrorCode.training_failed,
                    "post_training.rlvr: the weight board holds no weight-sync key",
                )
            self._sender = CollectiveSender(
                workers=self.s.fleet_workers,
                key=key,
                device=self.device,
                bucket_bytes=self.s.weight_sync_bucket_bytes,
                timeout_s=self.s.weight_sync_timeout_s,
            )
        return self._sender


__all__ = ["BOARD_KEEP", "RankPublisher", "WeightBoard", "board_name", "start_board", "take"]
