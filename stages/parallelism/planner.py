"""``validate_layout`` checks hand-set degrees; ``plan`` searches for the best ones.

The search enumerates TP (inside the NVLink domain), CP, PP (with 1F1B or
interleaved chunks), the split of data parallelism into FSDP shards and torchft
replica groups, micro-batch, recompute and precision; every candidate runs the same
checks as a hand-set layout, and the feasible one with the most tokens/s wins (ties
prefer fewer replicas' worth of memory headroom: less recompute, then smaller TP/PP).
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
    check_degrees,
    check_pipeline,
    check_precision,
    check_tp,
    resolve_dp_shard,
)
from stages.parallelism.hardware import Precision, load_fabric, load_gpu_sku
from stages.parallelism.memory import GIB, MemoryEstimate, estimate_memory, rank_params
from stages.parallelism.spec import (
    ActivationCheckpointing,
    Layout,
    MemoryBreakdown,
    PipelineSchedule,
    Plan,
    PlanRequest,
    Rejection,
    StepTimeBreakdown,
)
from stages.parallelism.throughput import (
    StepInputs,
    StepTime,
    model_flops_per_token,
    step_time,
)

MAX_VIRTUAL_STAGES = 8
MAX_MICRO_BATCH = 16
MIN_CP_CHUNK_TOKENS = 1024  # shorter ring-attention chunks leave the GPU idle
FSDP_SHARD_HINT = ("FSDP shards weights, gradients and AdamW state over dp_shard x cp = {n} "
                   "GPUs")


def resolve(request: PlanRequest) -> Context:
    preset = request.preset()
    sku = load_gpu_sku(request.gpu_sku)
    fabric = load_fabric(request.fabric)
    seq_len = request.resolved_seq_len()
    if seq_len > preset.max_position_embeddings:
        raise ItoError(ErrorCode.plan_batch_not_divisible,
                       f"sequence of {seq_len} tokens exceeds {preset.name}'s context of "
                       f"{preset.max_position_embeddings}")
    return Context(request, preset, sku, fabric, seq_len)


@dataclass(frozen=True)
class _Assessment:
    layout: Layout
    dp_shard: int
    accum: int
    stage_layers: tuple[int, ...]
    mem: MemoryEstimate
    peak: float
    capacity: float
    st: StepTime
    tokens_per_s: float
    mfu: float


def _evaluate(ctx: Context, layout: Layout, *, explain: bool) -> Plan:
    return _to_plan(ctx, _assess(ctx, layout), explain=explain)


def _assess(ctx: Context, layout: Layout) -> _Assessment:
    """All checks in CHECK_ORDER, then the predictions; raises the first refusal."""
    req = ctx.request
    dp_shard = resolve_dp_shard(ctx, layout)
    check_degrees(ctx, layout, dp_shard)
    check_tp(ctx, layout)
    stage_layers = check_pipeline(ctx, layout)
    accum = check_batch(ctx, layout, dp_shard)
    check_precision(ctx, layout)
    fsdp = dp_shard * layout.cp
    mem = estimate_memory(
        ctx.preset, seq_len=ctx.seq_len, micro_batch=layout.micro_batch, microbatches=accum,
        tp=layout.tp, cp=layout.cp, fsdp=fsdp, dp_replicate=layout.dp_replicate,
        pp_stage_layers=list(stage_layers), pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
        activation_checkpointing=layout.activation_checkpointing, precision=layout.precision,
        foreach_optimizer=ctx.sku.intra_node_link != "loopback")
    capacity = ctx.sku.memory_gib * req.memory_utilization
    peak = mem.total / GIB
    if peak > capacity:
        raise ItoError(ErrorCode.plan_out_of_memory,
                       f"predicted peak {peak:.1f} GiB per GPU exceeds the usable "
                       f"{capacity:.1f} GiB of {ctx.sku.name} (weights {mem.weights / GIB:.1f}, "
                       f"gradients {mem.gradients / GIB:.1f}, optimizer {mem.optimizer / GIB:.1f}"
                       f", activations {mem.activations / GIB:.1f}, buffers "
                       f"{mem.buffers / GIB:.1f})",
                       details={"peak_memory_gib": round(peak, 2)})
    pp = layout.pp
    # the rank with the most parameters sets FSDP traffic and the optimizer step
    local_params = max(rank_params(ctx.preset, stage_layers[r], layout.tp, r == 0, r == pp - 1)
                       for r in {0, pp - 1, stage_layers.index(max(stage_layers))})
    st = step_time(StepInputs(
        ctx.preset, ctx.sku, ctx.fabric, req.gpus_per_node, ctx.seq_len, layout.tp, layout.cp,
        dp_shard, layout.dp_replicate, stage_layers, layout.pp_virtual_stages,
        layout.micro_batch, accum, layout.activation_checkpointing, layout.precision,
        local_params))
    if pp > 1:
        bubble = st.pp_bubble / st.total
        if bubble > req.max_pp_bubble:
            raise ItoError(ErrorCode.plan_pp_bubble_too_large,
                           f"pipeline bubble of PP {pp} with {accum} micro-batches and "
                           f"{layout.pp_virtual_stages} chunk(s) per rank is {bubble:.0%} of the "
                           f"step (bound {req.max_pp_bubble:.0%})")
    tokens_per_s = req.global_batch_tokens / st.total
    # MFU against the peak of the precision used: fp8 plans are not flattered by
    # being divided by the (half as fast) bf16 peak.
    mfu = tokens_per_s * model_flops_per_token(ctx.preset, ctx.seq_len) / (
        ctx.world * ctx.sku.peak_tflops(layout.precision) * 1e12)
    floor = ctx.sku.mfu_floor if req.mfu_floor is None else req.mfu_floor
    if mfu < floor:
        raise ItoError(ErrorCode.plan_wasteful,
                       f"predicted MFU {mfu:.1%} is under the floor of {floor:.0%} for "
                       f"{ctx.sku.name}: the booking would mostly wait on "
                       f"{_dominant_wait(st)}", details={"mfu": round(mfu, 4)})
    return _Assessment(layout, dp_shard, accum, stage_layers, mem, peak, capacity, st,
                       tokens_per_s, mfu)


def _to_plan(ctx: Context, a: _Assessment, *, explain: bool) -> Plan:
    req, layout, mem, st, peak = ctx.request, a.layout, a.mem, a.st, a.peak
    dp_shard, accum, stage_layers, capacity = a.dp_shard, a.accum, a.stage_layers, a.capacity
    pp, tokens_per_s, mfu = layout.pp, a.tokens_per_s, a.mfu
    reasons = _reasons(ctx, layout, dp_shard, accum, st, mem, peak, capacity) if explain else []
    return Plan(
        model=ctx.preset.name, gpu_sku=ctx.sku.name, fabric=ctx.fabric.name,
        gpus_per_node=req.gpus_per_node, node_count=req.node_count, world_size=ctx.world,
        global_batch_tokens=req.global_batch_tokens, seq_len=ctx.seq_len,
        tp=layout.tp, pp=pp, pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages, pp_microbatches=accum,
        pp_stage_layers=list(stage_layers), cp=layout.cp, dp_shard=dp_shard,
        dp_replicate=layout.dp_replicate, micro_batch=layout.micro_batch, grad_accum=accum,
        activation_checkpointing=layout.activation_checkpointing, precision=layout.precision,
        peak_memory_gib=round(peak, 3),
        memory=MemoryBreakdown(
            weights=round(mem.weights / GIB, 3), gradients=round(mem.gradients / GIB, 3),
            optimizer=round(mem.optimizer / GIB, 3), activations=round(mem.activations / GIB, 3),
            buffers=round(mem.buffers / GIB, 3), total=round(peak, 3),
            capacity=round(capacity, 3)),
        step_time_s=round(st.total, 6),
        step_time=StepTimeBreakdown(
            compute=st.compute, pp_bubble=st.pp_bubble, tp_comm=st.tp_comm, cp_comm=st.cp_comm,
            fsdp_comm=st.fsdp_comm, replicate_comm=st.replicate_comm, pp_comm=st.pp_comm,
            optimizer=st.optimizer, total=st.total),
        tokens_per_s=round(tokens_per_s, 3), mfu=round(mfu, 4), reasons=reasons)


def _dominant_wait(st: StepTime) -> str:
    parts = {k: getattr(st, k) for k in ("pp_bubble", "tp_comm", "cp_comm", "fsdp_comm",
                                           "replicate_comm", "pp_comm", "optimizer")}
    name, value = max(parts.items(), key=lambda kv: kv[1])
    if value < st.compute * 0.5:
        return "small, memory-bound kernels"
    return name.replace("_", " ")


def _reasons(ctx: Context, layout: Layout, dp_shard: int, accum: int, st: object,
             mem: object, peak: float, capacity: float) -> list[str]:
    r = [f"{ctx.preset.name} ({ctx.preset.num_params / 1e9:.3g}B params) on {ctx.world} x "
         f"{ctx.sku.name} ({ctx.request.node_count} node(s) over {ctx.fabric.name})"]
    r.append(f"predicted peak {peak:.1f} of {capacity:.1f} usable GiB per GPU")
    if layout.tp > 1:
        r.append(f"TP {layout.tp} inside the NVLink domain splits each layer's GEMMs and "
                 f"activations {layout.tp} ways (sequence parallel on)")
    if layout.pp > 1:
        r.append(f"PP {layout.pp} ({layout.pp_schedule}, {layout.pp_virtual_stages} chunk(s) "
                 f"per rank, {accum} micro-batches) splits the layers where TP and FSDP alone "
                 f"do not fit or scale")
    if layout.cp > 1:
        r.append(f"CP {layout.cp} splits each {ctx.seq_len}-token sequence (ring attention)")
    if dp_shard * layout.cp > 1:
        r.append(FSDP_SHARD_HINT.format(n=dp_shard * layout.cp))
    if layout.dp_replicate > 1:
        r.append(f"{layout.dp_replicate} torchft replica groups: a failed group is healed "
                 f"live while the others keep training")
    if layout.activation_checkpointing != "none":
        r.append(f"{layout.activation_checkpointing} activation checkpointing, the least "
                 f"recompute that fits or is fastest")
    return r


@dataclass(order=True)
class _Failure:
    sort_key: tuple[float, ...]
    layout: str = field(compare=False)
    code: ErrorCode = field(compare=False)
    reason: str = field(compare=False)


def validate_layout(request: PlanRequest, layout: Layout) -> Plan:
    """Check hand-set degrees and predict their memory and speed; raises ``ItoError``
    with the first refusal (plan_* code) in CHECK_ORDER."""
    return _evaluate(resolve(request), layout, explain=True)


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
            shards = sorted(_shard_options(dp, tp * cp, req.gpus_per_node), reverse=True)
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
    feasible: list[tuple[float, int, _Assessment]] = []
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

    best_by_precision: dict[str, _Assessment] = {}
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
    for rank, (neg_bound, _, g) in enumerate(queue):
        if feasible and -neg_bound < max(feasible)[0]:
            pruned = len(queue) - rank  # none of the rest can beat the best so far
            break
        oom_key = (g.tp, g.cp, g.pp, g.schedule, g.virtual, g.precision, "oom")
        if oom_key in structural:
            continue
        any_memory_fit = False
        for ac in g.recompute:
            fitted = stop_group = False
            for mb in g.micro_batches:
                layout = g.layout(mb, ac)
                i += 1
                try:
                    a = _assess(ctx, layout)
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
                           f"no layout of {ctx.world} GPUs exists for {ctx.preset.name}")
        code = max(counts, key=lambda c: (reached[c], counts[c]))
        best = max(failures[code])
        rejected = [r.model_dump() for r in _as_rejections(ranked_failures, [], keep)]
        raise ItoError(code, f"no layout of {ctx.world} x {ctx.sku.name} fits "
                       f"{ctx.preset.name}; the closest: {best.layout}: {best.reason}",
                       details={"rejected": rejected,
                                "refusal_counts": {str(k): v for k, v in counts.items()}})
    ordered = [_to_plan(ctx, a, explain=False)
               for _, _, a in sorted(feasible, key=lambda t: (t[0], t[1]), reverse=True)]
    chosen = _evaluate(ctx, ordered[0].layout(), explain=True)
    if request.precision == "auto" and ctx.sku.supports_fp8:
        chosen.reasons.append(_fp8_reason(chosen, best_by_precision, request.fp8_min_speedup))
    slower = [p for p in ordered if p.layout() != chosen.layout()]
    alternatives = _as_rejections(ranked_failures, [(p, chosen) for p in slower], keep)
    chosen.reasons.append(
        f"fastest of {i} candidate layouts assessed ({pruned} groups skipped that could "
        f"not beat it); "
        + ", ".join(f"{v} refused {k}" for k, v in sorted(counts.items())))
    return chosen.model_copy(update={"rejected": alternatives})


def _fp8_reason(chosen: Plan, best: dict[str, _Assessment], margin: float) -> str:
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
            reason=f"feasible but {1 - p.tokens_per_s / chosen.tokens_per_s:.1%} slower",
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
