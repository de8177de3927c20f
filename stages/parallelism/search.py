"""The search behind ``plan``: a branch and bound over groups of candidate layouts.

Candidates are grouped by (TP, CP, PP, schedule and chunks, precision, FSDP shard
degree); inside a group the least recompute is tried first, each by growing
micro-batch. Checks that no dp split, micro-batch or recompute can change rule out
whole groups once; every other group gets an optimistic tokens/s bound, groups are
visited best bound first, and the search stops when no bound beats the best plan.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from stages.errors import ErrorCode, ItoError
from stages.parallelism.candidates import (
    CandidateGroup,
    candidate_groups,
    speed_bound,
    state_gib,
)
from stages.parallelism.checks import (
    CHECK_ORDER,
    Context,
    check_batch,
    check_pipeline,
    check_precision,
    check_tp,
)
from stages.parallelism.planner import Assessment, assess, evaluate, resolve, to_plan
from stages.parallelism.spec import (
    Layout,
    Plan,
    PlanRequest,
    Rejection,
)


@dataclass(order=True)
class _Failure:
    sort_key: tuple[float, ...]
    layout: str = field(compare=False)
    code: ErrorCode = field(compare=False)
    reason: str = field(compare=False)
    degrees: Layout = field(compare=False)


class _Deadline:
    """The search's time budget: checked between groups and candidates."""

    def __init__(self, budget_s: float | None):
        self.budget_s = budget_s
        self.at = None if budget_s is None else time.monotonic() + budget_s

    def check(self) -> None:
        if self.at is not None and time.monotonic() > self.at:
            raise ItoError(
                ErrorCode.plan_time_budget_exceeded,
                f"the layout search did not finish within {self.budget_s:g} s; "
                "nothing was planned (a smaller batch or model plans faster)",
            )


def plan(request: PlanRequest, time_budget_s: float | None = None) -> Plan:
    """The fastest feasible layout for the booking, with its reasons and the ranked
    alternatives it rejected. Raises the most informative refusal when none fits:
    the code of the candidates that got furthest through the checks, with the
    ranked rejected alternatives in ``ItoError.details["rejected"]``. With
    ``time_budget_s`` a search that runs longer raises ``plan_time_budget_exceeded``."""
    return plan_context(resolve(request), time_budget_s)


def plan_context(ctx: Context, time_budget_s: float | None = None) -> Plan:
    """``plan`` for a resolved request: hardware that has no profile in configs/
    (a published run's) plans through a ``Context`` built around its ``GpuSku``."""
    search = _Search(ctx, _Deadline(time_budget_s))
    for g in search.queue():
        search.deadline.check()
        if search.beaten(g):
            break
        search.explore(g)
    return search.result()


def _kept_for_rollout(request: PlanRequest) -> str:
    """A refusal's note on a world the rollout workers shrank: their count is the knob."""
    held = request.rollout_gpus_per_node
    if not held:
        return ""
    return (
        f" (the trainer's {request.gpus_per_node} of each node's "
        f"{request.gpus_per_node + held} GPUs: {held} kept for RLVR's rollout workers)"
    )


class _Search:
    """Branch and bound: whole groups are ruled out by the checks that do not depend
    on micro-batch or recompute, the rest are visited best bound first, and the
    search stops once no remaining bound can beat the best layout found."""

    def __init__(self, ctx: Context, deadline: _Deadline | None = None):
        self.ctx, self.request = ctx, ctx.request
        self.deadline = deadline or _Deadline(None)
        self.keep = max(self.request.max_alternatives, 1)
        self.capacity = ctx.sku.memory_gib * self.request.memory_utilization
        self.margin = 1 - self.request.replica_preference_margin
        # the best feasible layouts: (score, -index, assessment), a bounded min-heap
        self.feasible: list[tuple[float, int, Assessment]] = []
        self.best_by_precision: dict[str, Assessment] = {}
        self.failures: dict[ErrorCode, list[_Failure]] = {}
        self.counts: dict[ErrorCode, int] = {}
        self.reached: dict[ErrorCode, int] = {}  # furthest check stage per refusal code
        self.ruled_out: set[tuple[object, ...]] = set()
        self.stage_layers: dict[tuple[object, ...], tuple[int, ...]] = {}
        self.assessed = 0
        self.pruned = 0
        self._queued = 0
        self._bounds: list[float] = []

    def handicap(self, precision: str) -> float:
        """auto precision takes fp8 only when it beats bf16 by fp8_min_speedup: rank
        (and prune) by tokens/s with fp8 discounted by that margin."""
        auto_fp8 = self.request.precision == "auto" and precision == "fp8"
        return self.request.fp8_min_speedup if auto_fp8 else 1.0

    def record(self, err: ItoError, layout: Layout) -> None:
        self.assessed += 1
        _record(self.failures, self.counts, self.reached, err, layout, self.assessed, self.keep)

    def queue(self) -> list[CandidateGroup]:
        """Groups that pass the checks no dp split, micro-batch or recompute can
        change, best speed bound first (ties keep the enumeration order: larger FSDP
        shard degrees first)."""
        ctx = self.ctx
        queued: list[tuple[float, int, CandidateGroup]] = []
        bounds: dict[tuple[object, ...], float] = {}
        for n, g in enumerate(candidate_groups(ctx)):
            self.deadline.check()
            key, batch_key = g.structure, g.structure[:4]
            if key in self.ruled_out or batch_key in self.ruled_out:
                continue
            if key not in self.stage_layers:
                head = g.layout(g.micro_batches[0], g.recompute[0])
                try:
                    check_tp(ctx, head)
                    layers = check_pipeline(ctx, head)
                    check_precision(ctx, head)
                except ItoError as err:
                    self.ruled_out.add(key)
                    self.record(err, head)
                    continue
                try:  # the smallest micro-batch must divide the batch (dp is in the key)
                    check_batch(ctx, head, g.dp_shard)
                except ItoError as err:
                    self.ruled_out.add(batch_key)
                    self.record(err, head)
                    continue
                self.stage_layers[key] = layers
            bound_key = (*key, g.schedule)
            if bound_key not in bounds:  # the dp split does not enter the bound
                bounds[bound_key] = speed_bound(ctx, g, self.stage_layers[key]) / self.handicap(
                    g.precision
                )
            queued.append((-bounds[bound_key], n, g))
        queued.sort()
        self._bounds = [-b for b, _, _ in queued]
        return [g for _, _, g in queued]

    def beaten(self, g: CandidateGroup) -> bool:
        """True when neither this group nor any after it can win (stop the search)."""
        bound = self._bounds[self._queued]
        self._queued += 1
        if not self.feasible:
            return False
        best_score, _, leader = max(self.feasible)
        if bound < best_score * self.margin:
            self.pruned += len(self._bounds) - self._queued + 1
            return True
        if bound < best_score and g.dp_replicate <= leader.layout.dp_replicate:
            self.pruned += 1  # slower, and no more replica groups to make up for it
            g.skip = True
        return False

    def explore(self, g: CandidateGroup) -> None:
        """Least recompute first, each by growing micro-batch."""
        oom_key = (*g.structure, g.schedule, "oom")
        if g.skip or oom_key in self.ruled_out:
            return
        state = state_gib(self.ctx, g, self.stage_layers[g.structure])
        if state > self.capacity:
            # weights, gradients and AdamW state alone overflow: no micro-batch or
            # recompute helps, and smaller shard degrees (later in the queue) need more
            self.record(
                ItoError(
                    ErrorCode.plan_out_of_memory,
                    f"weights, gradients and optimizer state alone need {state:.1f} GiB per "
                    f"GPU, over the usable {self.capacity:.1f} GiB of {self.ctx.sku.name}",
                    details={"peak_memory_gib": round(state, 2)},
                ),
                g.layout(g.micro_batches[0], "full"),
            )
            self.ruled_out.add(oom_key)
            return
        any_memory_fit = False
        for ac in g.recompute:
            fitted = stop_group = False
            for mb in g.micro_batches:
                self.deadline.check()
                layout = g.layout(mb, ac)
                try:
                    a = assess(self.ctx, layout)
                except ItoError as err:
                    self.record(err, layout)
                    if err.code == ErrorCode.plan_pp_bubble_too_large:
                        # fewer, larger micro-batches or more recompute only grow it
                        any_memory_fit = stop_group = True
                        break
                    if err.code == ErrorCode.plan_wasteful and "mfu" in err.details:
                        # it fit; a larger micro-batch may be efficient enough, more
                        # recompute never is
                        any_memory_fit = stop_group = True
                        continue
                    break  # memory and batch refusals only get worse with micro-batch
                self.assessed += 1
                fitted = any_memory_fit = True
                self.add(a)
            if fitted or stop_group:
                break
        if not any_memory_fit:
            self.ruled_out.add(oom_key)  # less sharding (later groups) needs more memory

    def add(self, a: Assessment) -> None:
        # prefer faster; on ties the simpler layout (earlier candidate)
        heapq.heappush(
            self.feasible, (a.tokens_per_s / self.handicap(a.layout.precision), -self.assessed, a)
        )
        if len(self.feasible) > self.keep + 1:
            heapq.heappop(self.feasible)
        prev = self.best_by_precision.get(a.layout.precision)
        if prev is None or a.tokens_per_s > prev.tokens_per_s:
            self.best_by_precision[a.layout.precision] = a

    def result(self) -> Plan:
        ctx, request = self.ctx, self.request
        ranked_failures = _rank_failures(self.failures, self.reached)
        if not self.feasible:
            kept = _kept_for_rollout(request)
            if not self.counts:
                raise ItoError(
                    ErrorCode.plan_no_feasible,
                    f"no layout of {ctx.world} GPUs{kept} exists for {ctx.preset.name} "
                    f"with at least {request.min_replica_groups} torchft replica "
                    f"group(s)",
                )
            code = max(self.counts, key=lambda c: (self.reached[c], self.counts[c]))
            best = max(self.failures[code])
            rejected = [r.model_dump() for r in _as_rejections(ranked_failures, [], self.keep)]
            raise ItoError(
                code,
                f"no layout of {ctx.world} x {ctx.sku.name}{kept} fits "
                f"{ctx.preset.name}; the closest: {best.layout}: {best.reason}",
                details={
                    "rejected": rejected,
                    "refusal_counts": {str(k): v for k, v in self.counts.items()},
                },
            )
        ranked = sorted(self.feasible, key=lambda t: (t[0], t[1]), reverse=True)
        # among layouts within the margin of the fastest, the most torchft replica groups
        near = [t for t in ranked if t[0] >= ranked[0][0] * self.margin]
        pick = max(near, key=lambda t: (t[2].layout.dp_replicate, t[0], t[1]))
        ranked.remove(pick)
        ordered = [to_plan(ctx, a, explain=False) for _, _, a in [pick, *ranked]]
        chosen = evaluate(ctx, ordered[0].layout(), explain=True)
        if ranked and ranked[0][0] > pick[0]:
            fastest = ranked[0][2]
            chosen.reasons.append(
                f"{chosen.dp_replicate} torchft replica groups chosen over a layout with "
                f"{fastest.layout.dp_replicate} that is predicted "
                f"{fastest.tokens_per_s / chosen.tokens_per_s - 1:.1%} faster (within the "
                f"{request.replica_preference_margin:.0%} fault-tolerance margin)"
            )
        if request.precision == "auto" and ctx.sku.supports_fp8:
            chosen.reasons.append(
                _fp8_reason(chosen, self.best_by_precision, request.fp8_min_speedup)
            )
        slower = [p for p in ordered if p.layout() != chosen.layout()]
        alternatives = _as_rejections(ranked_failures, [(p, chosen) for p in slower], self.keep)
        chosen.reasons.append(
            f"fastest of {self.assessed} candidate layouts assessed ({self.pruned} groups "
            f"skipped that could not beat it); "
            + ", ".join(f"{v} refused {k}" for k, v in sorted(self.counts.items()))
        )
        return chosen.model_copy(update={"rejected": alternatives})


def _fp8_reason(chosen: Plan, best: dict[str, Assessment], margin: float) -> str:
    take = f"auto precision takes fp8 when it is at least {margin - 1:.0%} faster than bf16"
    if "bf16" in best and "fp8" in best:
        gain = best["fp8"].tokens_per_s / best["bf16"].tokens_per_s - 1
        verdict = (
            "the GEMMs are big enough to be compute-bound"
            if chosen.precision == "fp8"
            else "the GEMMs are too small or too few for fp8 to pay"
        )
        return f"{take}; the best fp8 layout is predicted {gain:+.0%}: {verdict}"
    if chosen.precision == "fp8":
        return f"{take}; no bf16 layout could come within that margin"
    return f"{take}; no fp8 layout could beat this one by that margin"


def _stage(err: ItoError) -> int:
    """How far through the checks the refused layout got. "More GPUs than the batch"
    is a batch check, however late its code sits in CHECK_ORDER."""
    if err.code == ErrorCode.plan_wasteful and "mfu" not in err.details:
        return CHECK_ORDER[ErrorCode.plan_batch_not_divisible]
    return CHECK_ORDER[err.code]


def _record(
    failures: dict[ErrorCode, list[_Failure]],
    counts: dict[ErrorCode, int],
    reached: dict[ErrorCode, int],
    err: ItoError,
    layout: Layout,
    i: int,
    keep: int,
) -> None:
    counts[err.code] = counts.get(err.code, 0) + 1
    reached[err.code] = max(reached.get(err.code, -1), _stage(err))
    bucket = failures.setdefault(err.code, [])
    # closeness: the smallest memory overshoot, the highest MFU, else the earliest
    closeness = -float(err.details.get("peak_memory_gib", 0.0))  # type: ignore[arg-type]
    if err.code == ErrorCode.plan_wasteful:
        closeness = float(err.details.get("mfu", 0.0))  # type: ignore[arg-type]
    heapq.heappush(bucket, _Failure((closeness, -i), layout.label(), err.code, err.message, layout))
    if len(bucket) > keep:
        heapq.heappop(bucket)


def _rank_failures(
    failures: dict[ErrorCode, list[_Failure]], reached: dict[ErrorCode, int]
) -> list[_Failure]:
    """Furthest-through-the-checks first, the closest of each code first."""
    out: list[_Failure] = []
    for code in sorted(failures, key=lambda c: -reached[c]):
        out.extend(sorted(failures[code], reverse=True))
    return out


def _as_rejections(
    failures: list[_Failure], slower: list[tuple[Plan, Plan]], keep: int
) -> list[Rejection]:
    rows: list[Rejection] = []
    for p, chosen in slower[:keep]:
        rows.append(
            Rejection(
                rank=0,
                layout=p.layout().label(),
                degrees=p.layout(),
                code=None,
                reason=(
                    f"feasible but {1 - p.tokens_per_s / chosen.tokens_per_s:.1%} slower"
                    if p.tokens_per_s <= chosen.tokens_per_s
                    else f"feasible and {p.tokens_per_s / chosen.tokens_per_s - 1:.1%} faster, but "
                    f"with fewer torchft replica groups ({p.dp_replicate})"
                ),
                tokens_per_s=p.tokens_per_s,
                mfu=p.mfu,
                peak_memory_gib=p.peak_memory_gib,
            )
        )
    # one of each refusal first, then the rest, so every kind of refusal is shown
    firsts = {f.code: f for f in reversed(failures)}
    ordered = [f for f in failures if firsts.get(f.code) is f]
    ordered += [f for f in failures if firsts.get(f.code) is not f]
    for f in ordered[:keep]:
        rows.append(
            Rejection(rank=0, layout=f.layout, degrees=f.degrees, code=str(f.code), reason=f.reason)
        )
    for i, row in enumerate(rows, 1):
        row.rank = i
    return rows
