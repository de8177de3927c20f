"""How a layout's replica groups sync: every step, or DiLoCo every H inner steps.

Every step, torchft's replica groups allreduce their fp32 gradient shards after the
backward (``StepTime.replicate_comm``, not hidden). On a slow fabric that allreduce
can be most of the step. DiLoCo (``stages.replica_sync``) allreduces instead, every
``H`` inner steps, the pseudo-gradient: the same bytes as the fp32 gradients, so one
sync costs one ``replicate_comm``, and an outer Nesterov-SGD step follows. Per inner
step DiLoCo then costs

    T_diloco(H) = (T_every_step - R) + (R_bw + F x R_lat + T_outer) / H

with ``R = R_bw + R_lat`` the replicate allreduce (bandwidth and latency parts) and
``F`` fragments (streaming DiLoCo: F syncs of 1/F of the bytes per H steps, each
paying the latency). The planner plans DiLoCo when ``R`` exceeds
``PlanRequest.max_sync_share`` of the every-step step, with the smallest H whose
amortised sync is within ``PlanRequest.diloco_sync_share`` of the inner step, capped
at ``PlanRequest.max_sync_every`` and at ``PlanRequest.min_diloco_syncs`` syncs in the
run, and dividing every step count in
``PlanRequest.sync_divides`` (checkpoints and phase ends fall where groups agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

from stages.errors import ErrorCode, ItoError
from stages.parallelism.spec import PlanRequest
from stages.parallelism.throughput import StepTime
from stages.replica_sync import ReplicaSync

# The outer step (pseudo-gradient = backup - params, Nesterov momentum, params =
# backup - lr x update, backup = params) reads and writes ~6 fp32 arrays per parameter;
# AdamW's step (``StepTime.optimizer``) moves 8 (params, grads, both moments, read and
# written). Both are HBM-bound, so the outer step costs this share of AdamW's.
OUTER_STEP_SHARE_OF_ADAMW = 6 / 8


@dataclass(frozen=True)
class SyncChoice:
    """A layout's sync and the mean step time it predicts, with both modes' times."""

    sync: ReplicaSync
    step_time_s: float  # mean seconds per (inner) step of the chosen mode
    step_time_by_sync: dict[str, float]
    replicate_s: float  # one replicate allreduce of the fp32 gradient shards
    amortised_sync_s: float  # DiLoCo's sync + outer step per inner step; 0 every step
    reason: str | None  # None: nothing worth saying (one replica group, a fast fabric)


def sync_divisor(divides: list[int]) -> int | None:
    """The gcd of the step counts H must divide; None when nothing constrains H."""
    return reduce(math.gcd, divides) if divides else None


def check_pinned_sync(pin: ReplicaSync, divides: list[int]) -> None:
    """A pinned DiLoCo's H must divide every step count a checkpoint or a phase end
    falls on (``TrainStageConfig._sync_fits`` holds the run to the same)."""
    if pin.every_step:
        return
    bad = [n for n in divides if n % pin.sync_every]
    if bad:
        raise ItoError(
            ErrorCode.plan_sync_invalid,
            f"diloco's sync_every {pin.sync_every} does not divide step {bad[0]} (a "
            f"checkpoint interval or a phase's end): groups agree only at a sync; "
            f"H must divide {math.gcd(*divides)}",
        )


def _largest_h(request: PlanRequest) -> int:
    """The largest H planned: ``max_sync_every``, and ``min_diloco_syncs`` syncs in
    the run's steps when they are known."""
    if not request.sync_divides:
        return request.max_sync_every
    return min(request.max_sync_every, max(request.sync_divides) // request.min_diloco_syncs)


def _candidates(request: PlanRequest) -> list[int]:
    """H values allowed by the constraints, smallest first (2 .. ``_largest_h``)."""
    g = sync_divisor(request.sync_divides)
    top = _largest_h(request)
    if g is None:
        return list(range(2, top + 1))
    return [d for d in range(2, min(g, top) + 1) if g % d == 0]


def _diloco_time(st: StepTime, replicate_lat: float, sync: ReplicaSync) -> tuple[float, float]:
    """(mean seconds per inner step, amortised sync seconds) of DiLoCo at ``sync``."""
    inner = st.total - st.replicate_comm
    bandwidth = st.replicate_comm - replicate_lat
    outer = OUTER_STEP_SHARE_OF_ADAMW * st.optimizer
    amortised = (bandwidth + sync.fragments * replicate_lat + outer) / sync.sync_every
    return inner + amortised, amortised


def choose_sync(
    request: PlanRequest, st: StepTime, dp_replicate: int, replicate_lat: float, fabric: str
) -> SyncChoice:
    """The sync of one layout with step time ``st`` (every-step, ``replicate_comm``
    included) and ``replicate_lat`` seconds of latency in that allreduce: the
    manifest's pin, else every step unless the allreduce is over ``max_sync_share``
    of the step and some allowed H brings it within ``diloco_sync_share``."""
    pin = request.sync
    every = st.total
    times = {"every_step": every}
    if dp_replicate < 2:
        if pin is not None and not pin.every_step:
            raise ItoError(
                ErrorCode.plan_sync_invalid,
                "diloco syncs replica groups; this layout has one (the booking needs "
                "at least two GPUs for two groups)",
            )
        return SyncChoice(ReplicaSync(), every, times, 0.0, 0.0, None)
    r = st.replicate_comm
    share = r / every
    inner = every - r
    allreduce = f"replicate allreduce {_s(r)} = {share:.0%} of the {_s(every)} step on {fabric}"
    # The H DiLoCo would take: the smallest allowed H within the share, else the largest.
    candidates = _candidates(request)
    auto: ReplicaSync | None = None
    if candidates:
        outer = OUTER_STEP_SHARE_OF_ADAMW * st.optimizer
        needed = (r + outer) / (request.diloco_sync_share * inner) if inner > 0 else math.inf
        h = next((c for c in candidates if c >= needed), candidates[-1])
        auto = _outer_step(request, ReplicaSync(mode="diloco", sync_every=h))
    diloco = pin if pin is not None and not pin.every_step else auto
    if diloco is not None:
        times["diloco"], amortised = _diloco_time(st, replicate_lat, diloco)
    if pin is not None:
        if pin.every_step:
            return SyncChoice(pin, every, times, r, 0.0, f"{allreduce}: every step, as pinned")
        t = times["diloco"]
        return SyncChoice(
            pin, t, times, r, amortised, f"{allreduce}: {_diloco(pin, amortised, t)}, as pinned"
        )
    if share <= request.max_sync_share:
        return SyncChoice(
            ReplicaSync(),
            every,
            times,
            r,
            0.0,
            f"{allreduce}, within the {request.max_sync_share:.0%} share: every step",
        )
    if auto is None:
        g = sync_divisor(request.sync_divides)
        return SyncChoice(
            ReplicaSync(),
            every,
            times,
            r,
            0.0,
            f"{allreduce}, over the {request.max_sync_share:.0%} share, but no DiLoCo "
            f"interval from 2 to {_largest_h(request)} (at most {request.max_sync_every}, "
            f"and {request.min_diloco_syncs} syncs in the run) divides {g} (the checkpoint "
            "interval and phase ends): every step",
        )
    t = times["diloco"]
    short = (
        ""
        if amortised <= request.diloco_sync_share * inner * (1 + 1e-9)
        else f" (the cap of {_largest_h(request)} steps, {request.min_diloco_syncs} syncs "
        f"in the run, or the step counts it must divide keep it over "
        f"{request.diloco_sync_share:.0%})"
    )
    return SyncChoice(
        auto, t, times, r, amortised, f"{allreduce}: {_diloco(auto, amortised, t)}{short}"
    )


def _outer_step(request: PlanRequest, sync: ReplicaSync) -> ReplicaSync:
    """``sync`` with its outer optimizer: the paper's Nesterov SGD, or plain averaging
    for a run with fewer than ``nesterov_min_syncs`` syncs."""
    divides = request.sync_divides
    if divides and max(divides) // sync.sync_every < request.nesterov_min_syncs:
        return sync.model_copy(update={"outer_lr": 1.0, "outer_momentum": 0.0})
    return sync


def _diloco(sync: ReplicaSync, amortised: float, step: float) -> str:
    frag = f" in {sync.fragments} fragments" if sync.fragments > 1 else ""
    outer = (
        ", the groups' weights averaged (too few syncs for outer momentum)"
        if sync.outer_momentum == 0
        else ""
    )
    return (
        f"DiLoCo every {sync.sync_every} steps{frag}, sync {amortised / step:.0%} of "
        f"the {_s(step)} step{outer}"
    )


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"
