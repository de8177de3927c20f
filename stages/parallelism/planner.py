"""One layout's checks and predictions: ``validate_layout`` for hand-set degrees, and
``assess`` for each candidate of the search (``stages.parallelism.search.plan``)."""

from __future__ import annotations

from dataclasses import dataclass

from stages.errors import ErrorCode, ItoError
from stages.parallelism.checks import (
    Context,
    check_batch,
    check_degrees,
    check_pipeline,
    check_precision,
    check_tp,
    resolve_dp_shard,
)
from stages.parallelism.hardware import Fabric, load_fabric, resolve_gpu_sku
from stages.parallelism.memory import GIB, MemoryEstimate, estimate_memory, rank_params
from stages.parallelism.spec import (
    Layout,
    MemoryBreakdown,
    Plan,
    PlanRequest,
    StepTimeBreakdown,
)
from stages.parallelism.sync import SyncChoice, check_pinned_sync, choose_sync
from stages.parallelism.throughput import (
    StepInputs,
    StepTime,
    model_flops_per_token,
    replicate_allreduce,
    step_time,
)

FSDP_SHARD_HINT = "FSDP shards weights, gradients and AdamW state over dp_shard x cp = {n} GPUs"


def resolve(request: PlanRequest) -> Context:
    preset = request.preset()
    sku = resolve_gpu_sku(request.gpu_sku)
    fabric = request.fabric if isinstance(request.fabric, Fabric) else load_fabric(request.fabric)
    if request.sync is not None and not request.sync.every_step:
        check_pinned_sync(request.sync, request.sync_divides)
        if request.world_size < 2:
            raise ItoError(
                ErrorCode.plan_sync_invalid,
                "diloco syncs replica groups; a booking of one GPU has one group",
            )
        # a pinned DiLoCo needs groups to sync: plan at least two
        request = request.model_copy(
            update={"min_replica_groups": max(2, request.min_replica_groups)}
        )
    seq_len = request.resolved_seq_len()
    if seq_len > preset.max_position_embeddings:
        raise ItoError(
            ErrorCode.plan_batch_not_divisible,
            f"sequence of {seq_len} tokens exceeds {preset.name}'s context of "
            f"{preset.max_position_embeddings}",
        )
    return Context(request, preset, sku, fabric, seq_len)


@dataclass(frozen=True)
class Assessment:
    layout: Layout
    dp_shard: int
    accum: int
    stage_layers: tuple[int, ...]
    mem: MemoryEstimate
    peak: float
    capacity: float
    st: StepTime  # every-step breakdown (replicate_comm included)
    sync: SyncChoice
    tokens_per_s: float
    mfu: float


def evaluate(ctx: Context, layout: Layout, *, explain: bool) -> Plan:
    return to_plan(ctx, assess(ctx, layout), explain=explain)


def assess(ctx: Context, layout: Layout) -> Assessment:
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
        ctx.preset,
        seq_len=ctx.seq_len,
        micro_batch=layout.micro_batch,
        microbatches=accum,
        tp=layout.tp,
        cp=layout.cp,
        fsdp=fsdp,
        dp_replicate=layout.dp_replicate,
        pp_stage_layers=list(stage_layers),
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
        activation_checkpointing=layout.activation_checkpointing,
        precision=layout.precision,
        foreach_optimizer=ctx.sku.intra_node_link != "loopback",
    )
    capacity = ctx.sku.memory_gib * req.memory_utilization
    peak = mem.total / GIB
    if peak > capacity:
        raise ItoError(
            ErrorCode.plan_out_of_memory,
            f"predicted peak {peak:.1f} GiB per GPU exceeds the usable "
            f"{capacity:.1f} GiB of {ctx.sku.name} (weights {mem.weights / GIB:.1f}, "
            f"gradients {mem.gradients / GIB:.1f}, optimizer {mem.optimizer / GIB:.1f}"
            f", activations {mem.activations / GIB:.1f}, buffers "
            f"{mem.buffers / GIB:.1f})",
            details={"peak_memory_gib": round(peak, 2)},
        )
    pp = layout.pp
    # the rank with the most parameters sets FSDP traffic and the optimizer step
    local_params = max(
        rank_params(ctx.preset, stage_layers[r], layout.tp, r == 0, r == pp - 1)
        for r in {0, pp - 1, stage_layers.index(max(stage_layers))}
    )
    inputs = StepInputs(
        ctx.preset,
        ctx.sku,
        ctx.fabric,
        req.gpus_per_node,
        ctx.seq_len,
        layout.tp,
        layout.cp,
        dp_shard,
        layout.dp_replicate,
        stage_layers,
        layout.pp_virtual_stages,
        layout.micro_batch,
        accum,
        layout.activation_checkpointing,
        layout.precision,
        local_params,
    )
    st = step_time(inputs)
    sync = choose_sync(
        req, st, layout.dp_replicate, replicate_allreduce(inputs)[1], ctx.fabric.name
    )
    total = sync.step_time_s
    if pp > 1:
        bubble = st.pp_bubble / total
        if bubble > req.max_pp_bubble:
            raise ItoError(
                ErrorCode.plan_pp_bubble_too_large,
                f"pipeline bubble of PP {pp} with {accum} micro-batches and "
                f"{layout.pp_virtual_stages} chunk(s) per rank is {bubble:.0%} of the "
                f"step (bound {req.max_pp_bubble:.0%})",
            )
    tokens_per_s = req.global_batch_tokens / total
    # MFU against the peak of the precision used: fp8 plans are not flattered by
    # being divided by the (half as fast) bf16 peak.
    mfu = (
        tokens_per_s
        * model_flops_per_token(ctx.preset, ctx.seq_len)
        / (ctx.world * ctx.sku.peak_tflops(layout.precision) * 1e12)
    )
    floor = ctx.sku.mfu_floor if req.mfu_floor is None else req.mfu_floor
    if mfu < floor:
        raise ItoError(
            ErrorCode.plan_wasteful,
            f"predicted MFU {mfu:.1%} is under the floor of {floor:.0%} for "
            f"{ctx.sku.name}: the booking would mostly wait on "
            f"{_dominant_wait(st, sync)}",
            details={"mfu": round(mfu, 4)},
        )
    return Assessment(
        layout, dp_shard, accum, stage_layers, mem, peak, capacity, st, sync, tokens_per_s, mfu
    )


def to_plan(ctx: Context, a: Assessment, *, explain: bool) -> Plan:
    req, layout, mem, st, peak = ctx.request, a.layout, a.mem, a.st, a.peak
    dp_shard, accum, stage_layers, capacity = a.dp_shard, a.accum, a.stage_layers, a.capacity
    pp, tokens_per_s, mfu = layout.pp, a.tokens_per_s, a.mfu
    reasons = _reasons(ctx, layout, dp_shard, accum, st, mem, peak, capacity) if explain else []
    sync = a.sync
    if explain and sync.reason:
        reasons.append(sync.reason)
    diloco = not sync.sync.every_step
    return Plan(
        model=ctx.preset.name,
        gpu_sku=ctx.sku.name,
        fabric=ctx.fabric.name,
        gpus_per_node=req.gpus_per_node,
        node_count=req.node_count,
        rollout_gpus_per_node=req.rollout_gpus_per_node,
        world_size=ctx.world,
        global_batch_tokens=req.global_batch_tokens,
        seq_len=ctx.seq_len,
        tp=layout.tp,
        pp=pp,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
        pp_microbatches=accum,
        pp_stage_layers=list(stage_layers),
        cp=layout.cp,
        dp_shard=dp_shard,
        dp_replicate=layout.dp_replicate,
        micro_batch=layout.micro_batch,
        grad_accum=accum,
        activation_checkpointing=layout.activation_checkpointing,
        precision=layout.precision,
        peak_memory_gib=round(peak, 3),
        memory=MemoryBreakdown(
            weights=round(mem.weights / GIB, 3),
            gradients=round(mem.gradients / GIB, 3),
            optimizer=round(mem.optimizer / GIB, 3),
            activations=round(mem.activations / GIB, 3),
            buffers=round(mem.buffers / GIB, 3),
            total=round(peak, 3),
            capacity=round(capacity, 3),
        ),
        step_time_s=round(sync.step_time_s, 6),
        step_time=StepTimeBreakdown(
            compute=st.compute,
            pp_bubble=st.pp_bubble,
            tp_comm=st.tp_comm,
            cp_comm=st.cp_comm,
            fsdp_comm=st.fsdp_comm,
            replicate_comm=0.0 if diloco else st.replicate_comm,
            pp_comm=st.pp_comm,
            optimizer=st.optimizer,
            outer_sync=sync.amortised_sync_s,
            total=sync.step_time_s,
        ),
        sync=sync.sync,
        step_time_by_sync={k: round(v, 6) for k, v in sync.step_time_by_sync.items()},
        tokens_per_s=round(tokens_per_s, 3),
        mfu=round(mfu, 4),
        reasons=reasons,
    )


def _dominant_wait(st: StepTime, sync: SyncChoice) -> str:
    parts: dict[str, float] = {
        k: getattr(st, k)
        for k in (
            "pp_bubble",
            "tp_comm",
            "cp_comm",
            "fsdp_comm",
            "replicate_comm",
            "pp_comm",
            "optimizer",
        )
    }
    if not sync.sync.every_step:
        parts["replicate_comm"] = sync.amortised_sync_s
    name, value = max(parts.items(), key=lambda kv: kv[1])
    if value < st.compute * 0.5:
        return "small, memory-bound kernels"
    return name.replace("_", " ")


def _reasons(
    ctx: Context,
    layout: Layout,
    dp_shard: int,
    accum: int,
    st: object,
    mem: object,
    peak: float,
    capacity: float,
) -> list[str]:
    r = [
        f"{ctx.preset.name} ({ctx.preset.num_params / 1e9:.3g}B params) on {ctx.world} x "
        f"{ctx.sku.name} ({ctx.request.node_count} node(s) over {ctx.fabric.name})"
    ]
    r.append(f"predicted peak {peak:.1f} of {capacity:.1f} usable GiB per GPU")
    if layout.tp > 1:
        r.append(
            f"TP {layout.tp} inside the NVLink domain splits each layer's GEMMs and "
            f"activations {layout.tp} ways (sequence parallel on)"
        )
    if layout.pp > 1:
        r.append(
            f"PP {layout.pp} ({layout.pp_schedule}, {layout.pp_virtual_stages} chunk(s) "
            f"per rank, {accum} micro-batches) splits the layers where TP and FSDP alone "
            f"do not fit or scale"
        )
    if layout.cp > 1:
        r.append(f"CP {layout.cp} splits each {ctx.seq_len}-token sequence (ring attention)")
    if dp_shard * layout.cp > 1:
        r.append(FSDP_SHARD_HINT.format(n=dp_shard * layout.cp))
    if layout.dp_replicate > 1:
        r.append(
            f"{layout.dp_replicate} torchft replica groups: a failed group is healed "
            f"live while the others keep training"
        )
    if layout.activation_checkpointing != "none":
        r.append(
            f"{layout.activation_checkpointing} activation checkpointing, the least "
            f"recompute that fits or is fastest"
        )
    return r


def validate_layout(request: PlanRequest, layout: Layout) -> Plan:
    """Check hand-set degrees and predict their memory and speed; raises ``ItoError``
    with the first refusal (plan_* code) in CHECK_ORDER."""
    return evaluate(resolve(request), layout, explain=True)
