"""The refusals: one function per rule, each raising ``ItoError`` with a plan_* code.

``evaluate_layout`` runs them in a fixed order, cheapest and most structural first
(degrees, TP placement, heads, pipeline split, batch, precision), then the model-
based ones (memory, bubble, MFU). The order is also how informative a refusal is:
a layout that got further before failing says more about the booking.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from stages.errors import ErrorCode, ItoError
from stages.parallelism.hardware import Fabric, GpuSku
from stages.parallelism.spec import Layout, PlanRequest
from stages.presets import ModelPreset

# Stage index of each refusal code in the check order (higher = got further).
CHECK_ORDER: dict[ErrorCode, int] = {
    code: i
    for i, code in enumerate(
        [
            ErrorCode.plan_degrees_mismatch,
            ErrorCode.plan_tp_across_nodes,
            ErrorCode.plan_tp_beyond_nvlink,
            ErrorCode.plan_heads_not_divisible,
            ErrorCode.plan_pp_layers_unbalanced,
            ErrorCode.plan_batch_not_divisible,
            ErrorCode.plan_fp8_unsupported,
            ErrorCode.plan_out_of_memory,
            ErrorCode.plan_pp_bubble_too_large,
            ErrorCode.plan_wasteful,
        ]
    )
}


@dataclass(frozen=True)
class Context:
    """A resolved request: the preset, hardware and batch shape."""

    request: PlanRequest
    preset: ModelPreset
    sku: GpuSku
    fabric: Fabric
    seq_len: int

    @property
    def world(self) -> int:
        return self.request.world_size

    @property
    def sequences(self) -> int:
        return self.request.global_batch_tokens // self.seq_len


def resolve_dp_shard(ctx: Context, layout: Layout) -> int:
    """dp_shard, inferring -1 from the others (torchtitan's convention)."""
    if layout.dp_shard != -1:
        return layout.dp_shard
    rest = layout.tp * layout.pp * layout.cp * layout.dp_replicate
    if ctx.world % rest:
        raise ItoError(
            ErrorCode.plan_degrees_mismatch,
            f"tp x pp x cp x dp_replicate = {rest} does not divide the "
            f"{ctx.world} GPUs of the booking",
        )
    return ctx.world // rest


def check_degrees(ctx: Context, layout: Layout, dp_shard: int) -> None:
    product = layout.tp * layout.pp * layout.cp * dp_shard * layout.dp_replicate
    if product != ctx.world:
        raise ItoError(
            ErrorCode.plan_degrees_mismatch,
            f"tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp_shard {dp_shard} "
            f"x dp_replicate {layout.dp_replicate} = {product}, but the booking has "
            f"{ctx.world} GPUs",
        )


def check_tp(ctx: Context, layout: Layout) -> None:
    tp, per_node = layout.tp, ctx.request.gpus_per_node
    if tp > per_node or per_node % tp:
        raise ItoError(
            ErrorCode.plan_tp_across_nodes,
            f"TP {tp} would span nodes of {per_node} GPUs; TP all-gathers every "
            f"layer and must stay inside one node",
        )
    if tp > ctx.sku.nvlink_domain:
        raise ItoError(
            ErrorCode.plan_tp_beyond_nvlink,
            f"TP {tp} exceeds the NVLink domain of {ctx.sku.nvlink_domain} on "
            f"{ctx.sku.name}; TP collectives would cross {ctx.sku.intra_node_link}",
        )
    p = ctx.preset
    if p.num_attention_heads % tp or p.num_key_value_heads % tp:
        raise ItoError(
            ErrorCode.plan_heads_not_divisible,
            f"TP {tp} does not divide {p.num_attention_heads} attention heads and "
            f"{p.num_key_value_heads} KV heads",
        )


@cache
def head_cost_in_layers(preset: ModelPreset, seq_len: int) -> float:
    """Output projection + loss compute, in units of one decoder layer."""
    attn, mlp = preset.layer_params()
    layer = (
        2 * (attn + mlp * max(1, preset.experts_per_token) / max(1, preset.num_experts))
        + 2 * preset.hidden_size * seq_len
    )
    return 2 * preset.vocab_size * preset.hidden_size / layer


@cache
def split_layers(
    layers: int, pp: int, virtual: int, head_cost: float
) -> tuple[tuple[int, ...], float]:
    """Contiguous split of ``layers`` into ``pp x virtual`` chunks, chunk j on rank
    j % pp; the last chunk also runs the output head. Returns (decoder layers per rank,
    imbalance = slowest rank / mean rank - 1). Like Llama 3 405B (126 layers on 16
    stages), the last chunk takes fewer layers to make room for the head."""
    chunks = pp * virtual
    if chunks > layers:
        return (), float("inf")
    best: tuple[tuple[float, float], list[int]] | None = None
    for last in range(1, -(-layers // chunks) + 1):
        rest, others = layers - last, chunks - 1
        if others == 0:
            if rest:
                continue
            counts = [last]
        else:
            if rest < others:
                continue
            base, extra = divmod(rest, others)
            # the extra layers go to the middle chunks; the first holds the embedding
            counts = [base + (1 if others - 1 - i < extra else 0) for i in range(others)]
            counts.append(last)
        per_rank = [0.0] * pp
        for j, c in enumerate(counts):
            per_rank[j % pp] += c
        per_rank[-1] += head_cost
        # slowest rank first; among equals the most even split (Llama 3's 7, 8 x 14, 7)
        score = (max(per_rank), sum(x * x for x in per_rank))
        if best is None or score < best[0]:
            best = (score, counts)
    if best is None:
        return (), float("inf")
    (slowest, _), counts = best
    mean = (layers + head_cost) / pp
    ranks = [0] * pp
    for j, c in enumerate(counts):
        ranks[j % pp] += c
    return tuple(ranks), slowest / mean - 1


def check_pipeline(ctx: Context, layout: Layout) -> tuple[int, ...]:
    if layout.pp == 1 and layout.pp_virtual_stages == 1:
        return (ctx.preset.num_hidden_layers,)
    head = head_cost_in_layers(ctx.preset, ctx.seq_len)
    ranks, imbalance = split_layers(
        ctx.preset.num_hidden_layers, layout.pp, layout.pp_virtual_stages, head
    )
    if not ranks:
        raise ItoError(
            ErrorCode.plan_pp_layers_unbalanced,
            f"{ctx.preset.num_hidden_layers} layers cannot fill {layout.pp} PP "
            f"stages x {layout.pp_virtual_stages} chunks with at least one layer each",
        )
    if layout.pp > 1 and imbalance > ctx.request.max_pp_imbalance:
        raise ItoError(
            ErrorCode.plan_pp_layers_unbalanced,
            f"{ctx.preset.num_hidden_layers} layers plus the output head (worth "
            f"{head:.1f} layers) split over {layout.pp} stages leave the slowest "
            f"stage {imbalance:.0%} above the mean (bound "
            f"{ctx.request.max_pp_imbalance:.0%})",
        )
    return ranks


def check_batch(ctx: Context, layout: Layout, dp_shard: int) -> int:
    """Returns gradient-accumulation steps (pipeline micro-batches)."""
    tokens = ctx.request.global_batch_tokens
    if tokens % ctx.seq_len:
        raise ItoError(
            ErrorCode.plan_batch_not_divisible,
            f"global batch of {tokens} tokens is not a whole number of "
            f"{ctx.seq_len}-token sequences",
        )
    if ctx.seq_len % (2 * layout.cp) and layout.cp > 1:
        raise ItoError(
            ErrorCode.plan_batch_not_divisible,
            f"sequence of {ctx.seq_len} tokens does not split into 2 x CP "
            f"{layout.cp} load-balanced chunks",
        )
    dp = dp_shard * layout.dp_replicate
    seqs = ctx.sequences
    if seqs < dp:
        raise ItoError(
            ErrorCode.plan_wasteful,
            f"{seqs} sequences per step over {dp} data-parallel ranks is "
            f"{seqs / dp:.2g} per rank, a micro-batch under 1: more GPUs than the "
            f"batch can use",
        )
    if seqs % dp:
        raise ItoError(
            ErrorCode.plan_batch_not_divisible,
            f"{seqs} sequences per step do not divide into {dp} data-parallel ranks",
        )
    if (seqs // dp) % layout.micro_batch:
        raise ItoError(
            ErrorCode.plan_batch_not_divisible,
            f"{seqs // dp} sequences per data-parallel rank do not divide into "
            f"micro-batches of {layout.micro_batch}",
        )
    accum = seqs // (dp * layout.micro_batch)
    if layout.pp_schedule == "Interleaved1F1B" and layout.pp > 1 and accum < layout.pp:
        raise ItoError(
            ErrorCode.plan_batch_not_divisible,
            f"interleaved 1F1B needs at least {layout.pp} micro-batches per step, "
            f"the batch gives {accum}",
        )
    return accum


def check_precision(ctx: Context, layout: Layout) -> None:
    if layout.precision == "fp8" and not ctx.sku.supports_fp8:
        raise ItoError(
            ErrorCode.plan_fp8_unsupported, f"{ctx.sku.name} has no fp8 tensor cores; use bf16"
        )
    if layout.precision == "fp8" and not ctx.sku.trains_fp8:
        raise ItoError(
            ErrorCode.plan_fp8_unsupported,
            f"fp8 training (torchao float8) needs an H100-class GPU; "
            f"{ctx.sku.name} is not one; use bf16",
        )
