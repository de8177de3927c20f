"""The ladder probe's proxies on the run's own trainer ranks, so the driver (which
only coordinates) never builds or trains a model, and the probe computes on the
devices the run booked.

The trainer fleet is placed and warming while data prep runs (``StartEarly``), and
it holds the booking's devices: a GPU a rank on CUDA, a replica group's own cores on
CPU. A probe that asked for devices of its own would wait behind the fleet it comes
before, so it borrows the fleet's ranks instead: each of the replica groups' ranks
(a standby holds no device and trains none) takes a proxy, and whichever rank is free
first the next (``Dealer``; ``train_proxy`` through ``ReplicaWorker.run_borrowed``, in
a concurrency group beside the driver's calls) while its loop warms up and waits for
the data. The streams and eval windows go to the object store once; the stage logs
each proxy's score as it comes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from stages.data_prep.config import LadderProbeConfig
from stages.data_prep.ladder_jobs import ArmJob, ArmRunner
from stages.errors import ErrorCode, ItoError
from stages.trainer.rank.replica import BORROWED_GROUP  # light: no torch, no Ray

# How long the probe waits for the fleet's ranks to be placed (actor handles made,
# not warmed up: that goes on while they train proxies).
PLACEMENT_TIMEOUT_S = 600.0
# One proxy's bound (the testbed's take seconds; a GPU rung minutes).
ARM_TIMEOUT_S = 1800.0
# How often the driver checks for a cancel between finished proxies.
WAIT_S = 0.5


class NoRanks(Exception):
    """The run placed no trainer ranks (its train stage could not start): the probe is
    skipped, and the train stage reports why."""


class Dealer:
    """Which rank trains which proxy: one to each rank at first (arms alternate, so
    both arms start at once where two ranks are), then the next to whichever rank is
    free first. Dealt round robin up front, a rank that warmed up late (its model build
    beside its first proxy) held its second proxy while a faster rank sat idle."""

    def __init__(self, jobs: list[ArmJob], ranks: int):
        self._queue = list(jobs)
        self._ranks = ranks

    def first(self) -> list[tuple[int, ArmJob]]:
        """(rank, proxy) for each rank that starts one now."""
        return [(rank, self._queue.pop(0)) for rank in range(min(self._ranks, len(self._queue)))]

    def next_for(self, rank: int) -> ArmJob | None:
        """The proxy ``rank`` trains next, now that it finished one (None: no more)."""
        return self._queue.pop(0) if self._queue else None


def train_proxy(
    job: ArmJob, stream: np.ndarray, windows: np.ndarray, cfg: LadderProbeConfig
) -> tuple[float, str]:
    """One proxy trained and scored on the rank that runs it: (bits per byte, device).
    Ray sends this function to the rank by reference; torch is imported there, never in
    the driver."""
    from stages.data_prep.ladder_arm import score_arm

    return score_arm(job, stream, windows, cfg)


def rank_runner(fleet: Any, cancelled: Callable[[], bool]) -> ArmRunner:
    """Train the proxies on ``fleet``'s placed ranks (a ``stages.trainer.fleet.handoff.Fleet``)."""

    def run(
        jobs: list[ArmJob],
        streams: dict[str, np.ndarray],
        windows: np.ndarray,
        cfg: LadderProbeConfig,
    ) -> Iterator[tuple[ArmJob, float, str, str]]:
        import ray
        from ray.exceptions import RayError

        placed = fleet.placed_ranks(PLACEMENT_TIMEOUT_S)
        ranks = [(f"rg{g}/rank{r}", a) for (g, r), a in sorted(placed.items()) if g >= 0]
        if not ranks:
            raise NoRanks("the run's trainer ranks were not placed")
        stream_refs = {arm: ray.put(s) for arm, s in streams.items()}
        windows_ref = ray.put(windows)
        pending: dict[Any, tuple[ArmJob, int]] = {}

        def start(rank: int, job: ArmJob) -> None:
            call = ranks[rank][1].run_borrowed.options(concurrency_group=BORROWED_GROUP)
            ref = call.remote(train_proxy, job, stream_refs[job.arm], windows_ref, cfg)
            pending[ref] = (job, rank)

        dealer = Dealer(jobs, len(ranks))
        for rank, job in dealer.first():
            start(rank, job)
        # As many proxies a rank as when every rank keeps pace: a free rank taking the
        # next proxy only ends the probe sooner.
        bound = ARM_TIMEOUT_S * -(-len(jobs) // len(ranks))
        deadline = time.monotonic() + bound
        try:
            while pending:
                if cancelled():
                    raise InterruptedError("ladder probe cancelled")
                if time.monotonic() > deadline:
                    raise ItoError(
                        ErrorCode.stage_failed,
                        f"ladder probe: {len(pending)} proxies unfinished after {bound:.0f}s",
                    )
                done, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S)
                for ref in done:
                    job, rank = pending.pop(ref)
                    where = ranks[rank][0]
                    try:
                        bpb, device = ray.get(ref)
                    except RayError as e:  # the rank was lost, or the proxy failed
                        raise ItoError(
                            ErrorCode.stage_failed,
                            f"ladder probe: the {job.arm} proxy of seed {job.seed} failed on "
                            f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                        ) from None
                    following = dealer.next_for(rank)
                    if following is not None:
                        start(rank, following)
                    yield job, float(bpb), str(device), where
        finally:
            for ref in pending:  # queued ones never start; a running one ends with its rank
                with contextlib.suppress(Exception):
                    ray.cancel(ref)

    return run
