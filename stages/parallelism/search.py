"""The search behind ``plan``: a branch and bound over groups of candidate layouts.

Candidates are grouped by (TP, CP, PP, schedule and chunks, precision, FSDP shard
degree); inside a group the least recompute is tried first, each by growing
micro-batch. Checks that no dp split, micro-batch or recompute can change rule out
whole groups once; every other group gets an optimistic tokens/s bound, groups are
visited best bound first, and the search stops when no bound beats the best plan.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from stages.errors import ErrorCode, ItoError
from stages.parallelism.checks import (
    CHECK_ORDER,
    Context,
    check_batch,
    check_pipeline,
    check_precision,
    check_tp,
)
from stages.parallelism.hardware import Precision
from stages.parallelism.memory import GIB, GRAD_BYTES, MASTER_BYTES, OPTIMIZER_BYTES, rank_params
from stages.parallelism.planner import Assessment, assess, evaluate, resolve, to_plan
from stages.parallelism.spec import (
    ActivationCheckpointing,
    Layout,
    PipelineSchedule,
    Plan,
    PlanRequest,
    Rejection,
)
from stages.parallelism.throughput import StepInputs, step_time

MAX_VIRTUAL_STAGES = 8
MAX_MICRO_BATCH = 16
MIN_CP_CHUNK_TOKENS = 1024  # shorter ring-attention chunks leave the GPU idle


@dataclass(order=True)
class _Failure:
    sort_key: tuple[float, ...]
    layout: str = field(compare=False)
    code: ErrorCode = field(compare=False)
    reason: str = field(compare=False)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Group:
    """Layouts that differ only in micro-batch and recompute."""

    tp: int
    cp: int
    pp: int
    schedule: PipelineSchedule
    virtual: int
    precision: Precision
    dp_shard: int
    dp_replicate: int
    micro_batches: tuple[int, ...]
    recompute: tuple[ActivationCheckpointing, ...]

    def layout(self, micro_batch: int, ac: ActivationCheckpointing) -> Layout:
        # values are valid by construction: skip validation in the hot loop
        return Layout.model_construct(
            tp=self.tp, pp=self.pp, cp=self.cp, dp_shard=self.dp_shard,
            dp_replicate=self.dp_replicate, micro_batch=micro_batch,
            pp_schedule=self.schedule, pp_virtual_stages=self.virtual,
            activation_checkpointing=ac, precision=self.precision)


def _groups(ctx: Context) -> Iterator[_Group]:
    """Candidate groups. Inside a group the search tries the least recompute first,
    each by growing micro-batch; FSDP shard degrees come largest first, so a group
    that runs out of memory rules out the smaller shard degrees after it."""
    req, preset = ctx.request, ctx.preset
    world = ctx.world
    tps = [t for t in _divisors(req.gpus_per_node) if t <= ctx.sku.nvlink_domain
           and preset.num_attention_heads % t == 0 and preset.num_key_value_heads % t == 0]
    cps = [c for c in (1, 2, 4, 8, 16) if c == 1 or (
        ctx.seq_len % (2 * c) == 0 and ctx.seq_len // c >= MIN_CP_CHUNK_TOKENS)]
    if req.precision == "auto":
        precisions: list[Precision] = [ctx.sku.default_precision]
        if ctx.sku.supports_fp8 and ctx.sku.default_precision != "fp32":
            precisions.append("fp8")
    else:
        precisions = [req.precision]
    acs: tuple[ActivationCheckpointing, ...] = (
        ("none", "selective", "full") if req.activation_checkpointing == "auto"
        else (req.activation_checkpointing,))
    seqs = max(1, ctx.sequences)
    for tp, cp in itertools.product(tps, cps):
        if world % (tp * cp):
            continue
        for pp in _divisors(world // (tp * cp)):
            if pp > preset.num_hidden_layers:
                break
            dp = world // (tp * cp * pp)
            schedules: list[tuple[PipelineSchedule, int]] = [("1F1B", 1)]
            if pp > 1:
                schedules += [("Interleaved1F1B", v) for v in (2, 4, 8)
                              if v <= MAX_VIRTUAL_STAGES and pp * v <= preset.num_hidden_layers]
            local = seqs // dp if seqs % dp == 0 else 0
            mbs = tuple(m for m in _divisors(local) if m <= MAX_MICRO_BATCH) if local else (1,)
            shards = sorted((d for d in _shard_options(dp, tp * cp, req.gpus_per_node)
                             if dp // d >= req.min_replica_groups), reverse=True)
            for (sched, v), prec, dp_shard in itertools.product(schedules, precisions, shards):
                yield _Group(tp, cp, pp, sched, v, prec, dp_shard, dp // dp_shard, mbs, acs)


def _speed_bound(ctx: Context, g: _Group, stage_layers: tuple[int, ...]) -> float:
    """Tokens/s no layout of the group can beat: no recompute, no FSDP or replica
    traffic, and per component the better of the smallest and largest micro-batch
    (large ones run GEMMs faster, small ones shrink the pipeline bubble)."""
    parts = []
    for mb in {g.micro_batches[0], g.micro_batches[-1]}:
        accum = max(1, ctx.sequences // (g.dp_shard * g.dp_replicate * mb))
        parts.append(step_time(StepInputs(
            ctx.preset, ctx.sku, ctx.fabric, ctx.request.gpus_per_node, ctx.seq_len, g.tp,
            g.cp, 1, 1, stage_layers, g.virtual, mb, accum, "none", g.precision, 0.0)))
    floor = (min(p.compute for p in parts) + min(p.pp_bubble for p in parts)
             + min(p.tp_comm for p in parts) + min(p.cp_comm for p in parts))
    return ctx.request.global_batch_tokens / floor


def _state_gib(ctx: Context, g: _Group, stage_layers: tuple[int, ...]) -> float:
    """GiB of fp32 weights, gradients and AdamW moments on the fullest rank."""
    pp = len(stage_layers)
    params = max(rank_params(ctx.preset, stage_layers[r], g.tp, r == 0, r == pp - 1)
                 for r in {0, pp - 1, stage_layers.index(max(stage_layers))})
    return (MASTER_BYTES + GRAD_BYTES + OPTIMIZER_BYTES) * params / (g.dp_shard * g.cp) / GIB


def _shard_options(dp: int, inner: int, per_node: int) -> list[int]:
    """FSDP shard degrees worth trying: 1 (replicas only), whole powers of two that
    end on node boundaries (HSDP: shard inside a group of nodes, torchft replicas
    across groups), and all of dp (pure FSDP). Others only add comm in the model."""
    out = {1, dp}
    d = 1
    while d < dp:
        d *= 2
        if dp % d == 0 and (d * inner) % per_node == 0:
            out.add(d)
    if (per_node // inner) and dp % max(1, per_node // inner) == 0:
        out.add(max(1, per_node // inner))
    return sorted(out)


def plan(request: PlanRequest) -> Plan:
    """The fastest feasible layout for the booking, with its reasons and the ranked
    alternatives it rejected. Raises the most informative refusal when none fits:
    the code of the candidates that got furthest through the checks, with the
    ranked rejected alternatives in ``ItoError.details["rejected"]``."""
    ctx = resolve(request)
    feasible: list[tuple[float, int, Assessment]] = []
    failures: dict[ErrorCode, list[_Failure]] = {}
    counts: dict[ErrorCode, int] = {}
    reached: dict[ErrorCode, int] = {}  # furthest check stage per refusal code
    keep = max(request.max_alternatives, 1)
    i = 0
    # Branch and bound: rule out whole groups with the checks that do not depend on
    # micro-batch or recompute, then visit the rest best bound first and stop once
    # no remaining group can beat the best layout found.
    structural: set[tuple[object, ...]] = set()

    def handicap(precision: str) -> float:
        # auto precision takes fp8 only when it beats bf16 by fp8_min_speedup: rank
        # (and prune) by tokens/s with fp8 discounted by that margin
        auto_fp8 = request.precision == "auto" and precision == "fp8"
        return request.fp8_min_speedup if auto_fp8 else 1.0

    best_by_precision: dict[str, Assessment] = {}
    queue: list[tuple[float, int, _Group]] = []
    bounds: dict[tuple[object, ...], float] = {}
    checked: dict[tuple[object, ...], tuple[int, ...]] = {}  # key -> stage layers
    for n, g in enumerate(_groups(ctx)):
        key = (g.tp, g.cp, g.pp, g.virtual, g.precision)
        batch_key = (g.tp, g.cp, g.pp, g.virtual)
        if key in structural or batch_key in structural:
            continue
        if key not in checked:
            head = g.layout(g.micro_batches[0], g.recompute[0])
            try:
                check_tp(ctx, head)
                stage_layers = check_pipeline(ctx, head)
                check_precision(ctx, head)
            except ItoError as err:
                structural.add(key)
                i += 1
                _record(failures, counts, reached, err, head, i, keep)
                continue
            try:  # the smallest micro-batch must divide the batch; dp is fixed by the key
                check_batch(ctx, head, g.dp_shard)
            except ItoError as err:
                structural.add(batch_key)
                i += 1
                _record(failures, counts, reached, err, head, i, keep)
                continue
            checked[key] = stage_layers
        stage_layers = checked[key]
        bound_key = (g.tp, g.cp, g.pp, g.schedule, g.virtual, g.precision)
        if bound_key not in bounds:  # the dp split does not enter the bound
            bounds[bound_key] = _speed_bound(ctx, g, stage_layers) / handicap(g.precision)
        queue.append((-bounds[bound_key], n, g))
    queue.sort()
    pruned = 0
    margin = 1 - request.replica_preference_margin
    capacity = ctx.sku.memory_gib * request.memory_utilization
    for rank, (neg_bound, _, g) in enumerate(queue):
        if feasible:
            best_score, _, leader = max(feasible)
            if -neg_bound < best_score * margin:
                pruned += len(queue) - rank  # none of the rest can beat the best so far
                break
            if -neg_bound < best_score and g.dp_replicate <= leader.layout.dp_replicate:
                pruned += 1  # slower, and no more replica groups to make up for it
                continue
        oom_key = (g.tp, g.cp, g.pp, g.schedule, g.virtual, g.precision, "oom")
        if oom_key in structural:
            continue
        if _state_gib(ctx, g, checked[(g.tp, g.cp, g.pp, g.virtual, g.precision)]) > capacity:
            # weights, gradients and AdamW state alone overflow: no micro-batch or
            # recompute helps, and smaller shard degrees (later in the queue) need more
            i += 1
            _record(failures, counts, reached, ItoError(
                ErrorCode.plan_out_of_memory,
                f"weights, gradients and optimizer state alone need "
                f"{_state_gib(ctx, g, checked[(g.tp, g.cp, g.pp, g.virtual, g.precision)]):.1f}"
                f" GiB per GPU, over the usable {capacity:.1f} GiB of {ctx.sku.name}",
                details={"peak_memory_gib": 1e9}), g.layout(g.micro_batches[0], "full"), i, keep)
            structural.add(oom_key)
            continue
        any_memory_fit = False
        for ac in g.recompute:
            fitted = stop_group = False
            for mb in g.micro_batches:
                layout = g.layout(mb, ac)
                i += 1
                try:
                    a = assess(ctx, layout)
                except ItoError as err:
                    _record(failures, counts, reached, err, layout, i, keep)
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
                fitted = any_memory_fit = True
                # prefer faster; on ties the simpler layout (earlier candidate)
                heapq.heappush(feasible, (a.tokens_per_s / handicap(layout.precision), -i, a))
                if len(feasible) > keep + 1:
                    heapq.heappop(feasible)
                prev = best_by_precision.get(layout.precision)
                if prev is None or a.tokens_per_s > prev.tokens_per_s:
                    best_by_precision[layout.precision] = a
            if fitted or stop_group:
                break
        if not any_memory_fit:
            # less sharding (the groups that follow) needs even more memory
            structural.add((g.tp, g.cp, g.pp, g.schedule, g.virtual, g.precision, "oom"))
    ranked_failures = _rank_failures(failures, reached)
    if not feasible:
        if not counts:
            raise ItoError(ErrorCode.plan_no_feasible,
                           f"no layout of {ctx.world} GPUs exists for {ctx.preset.name} with "
                           f"at least {request.min_replica_groups} torchft replica group(s)")
        code = max(counts, key=lambda c: (reached[c], counts[c]))
        best = max(failures[code])
        rejected = [r.model_dump() for r in _as_rejections(ranked_failures, [], keep)]
        raise ItoError(code, f"no layout of {ctx.world} x {ctx.sku.name} fits "
                       f"{ctx.preset.name}; the closest: {best.layout}: {best.reason}",
                       details={"rejected": rejected,
                                "refusal_counts": {str(k): v for k, v in counts.items()}})
    ranked = sorted(feasible, key=lambda t: (t[0], t[1]), reverse=True)
    # among layouts within the margin of the fastest, the most torchft replica groups
    near = [t for t in ranked if t[0] >= ranked[0][0] * (1 - request.replica_preference_margin)]
    pick = max(near, key=lambda t: (t[2].layout.dp_replicate, t[0], t[1]))
    ranked.remove(pick)
    ordered = [to_plan(ctx, a, explain=False) for _, _, a in [pick, *ranked]]
    chosen = evaluate(ctx, ordered[0].layout(), explain=True)
    fastest = ranked[0][2] if ranked and ranked[0][0] > pick[0] else None
    if fastest is not None:
        chosen.reasons.append(
            f"{chosen.dp_replicate} torchft replica groups chosen over a layout with "
            f"{fastest.layout.dp_replicate} that is predicted "
            f"{fastest.tokens_per_s / chosen.tokens_per_s - 1:.1%} faster (within the "
            f"{request.replica_preference_margin:.0%} fault-tolerance margin)")
    if request.precision == "auto" and ctx.sku.supports_fp8:
        chosen.reasons.append(_fp8_reason(chosen, best_by_precision, request.fp8_min_speedup))
    slower = [p for p in ordered if p.layout() != chosen.layout()]
    alternatives = _as_rejections(ranked_failures, [(p, chosen) for p in slower], keep)
    chosen.reasons.append(
        f"fastest of {i} candidate layouts assessed ({pruned} groups skipped that could "
        f"not beat it); "
        + ", ".join(f"{v} refused {k}" for k, v in sorted(counts.items())))
    return chosen.model_copy(update={"rejected": alternatives})


def _fp8_reason(chosen: Plan, best: dict[str, Assessment], margin: float) -> str:
    take = f"auto precision takes fp8 when it is at least {margin - 1:.0%} faster than bf16"
    if "bf16" in best and "fp8" in best:
        gain = best["fp8"].tokens_per_s / best["bf16"].tokens_per_s - 1
        verdict = ("the GEMMs are big enough to be compute-bound" if chosen.precision == "fp8"
                   else "the GEMMs are too small or too few for fp8 to pay")
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


def _record(failures: dict[ErrorCode, list[_Failure]], counts: dict[ErrorCode, int],
            reached: dict[ErrorCode, int], err: ItoError, layout: Layout, i: int,
            keep: int) -> None:
    counts[err.code] = counts.get(err.code, 0) + 1
    reached[err.code] = max(reached.get(err.code, -1), _stage(err))
    bucket = failures.setdefault(err.code, [])
    # closeness: the smallest memory overshoot, the highest MFU, else the earliest
    closeness = -float(err.details.get("peak_memory_gib", 0.0))  # type: ignore[arg-type]
    if err.code == ErrorCode.plan_wasteful:
        closeness = float(err.details.get("mfu", 0.0))  # type: ignore[arg-type]
    heapq.heappush(bucket, _Failure((closeness, -i), layout.label(), err.code, err.message))
    if len(bucket) > keep:
        heapq.heappop(bucket)


def _rank_failures(failures: dict[ErrorCode, list[_Failure]],
                   reached: dict[ErrorCode, int]) -> list[_Failure]:
    """Furthest-through-the-checks first, the closest of each code first."""
    out: list[_Failure] = []
    for code in sorted(failures, key=lambda c: -reached[c]):
        out.extend(sorted(failures[code], reverse=True))
    return out


def _as_rejections(failures: list[_Failure], slower: list[tuple[Plan, Plan]],
                   keep: int) -> list[Rejection]:
    rows: list[Rejection] = []
    for p, chosen in slower[:keep]:
        rows.append(Rejection(
            rank=0, layout=p.layout().label(), code=None,
            reason=(f"feasible but {1 - p.tokens_per_s / chosen.tokens_per_s:.1%} slower"
                    if p.tokens_per_s <= chosen.tokens_per_s else
                    f"feasible and {p.tokens_per_s / chosen.tokens_per_s - 1:.1%} faster, but "
                    f"with fewer torchft replica groups ({p.dp_replicate})"),
            tokens_per_s=p.tokens_per_s, mfu=p.mfu, peak_memory_gib=p.peak_memory_gib))
    # one of each refusal first, then the rest, so every kind of refusal is shown
    firsts = {f.code: f for f in reversed(failures)}
    ordered = [f for f in failures if firsts.get(f.code) is f]
    ordered += [f for f in failures if firsts.get(f.code) is not f]
    for f in ordered[:keep]:
        rows.append(Rejection(rank=0, layout=f.layout, code=str(f.code), reason=f.reason))
    for i, row in enumerate(rows, 1):
        row.rank = i
    return rows
