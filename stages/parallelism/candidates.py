"""The layouts ``plan`` searches: candidate groups (layouts that differ only in
micro-batch and recompute), the FSDP shard degrees worth trying, and per group an
optimistic tokens/s bound and the optimizer state that no micro-batch or recompute
shrinks. ``search.py`` orders and prunes them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from stages.parallelism.checks import Context
from stages.parallelism.hardware import Precision
from stages.parallelism.memory import GIB, GRAD_BYTES, MASTER_BYTES, OPTIMIZER_BYTES, rank_params
from stages.parallelism.spec import ActivationCheckpointing, Layout, PipelineSchedule
from stages.parallelism.throughput import StepInputs, step_time

MAX_VIRTUAL_STAGES = 8
MAX_MICRO_BATCH = 16
MIN_CP_CHUNK_TOKENS = 1024  # shorter ring-attention chunks leave the GPU idle


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, in O(sqrt(n)) steps (never linear in a
    batch size a request may make huge)."""
    small: list[int] = []
    large: list[int] = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass
class CandidateGroup:
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
    skip: bool = False  # set by the search: slower than the best, nothing to add

    @property
    def structure(self) -> tuple[int, int, int, int, str]:
        """What the structural checks depend on: (tp, cp, pp, chunks, precision)."""
        return (self.tp, self.cp, self.pp, self.virtual, self.precision)

    def layout(self, micro_batch: int, ac: ActivationCheckpointing) -> Layout:
        # values are valid by construction: skip validation in the hot loop
        return Layout.model_construct(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            dp_shard=self.dp_shard,
            dp_replicate=self.dp_replicate,
            micro_batch=micro_batch,
            pp_schedule=self.schedule,
            pp_virtual_stages=self.virtual,
            activation_checkpointing=ac,
            precision=self.precision,
        )


def candidate_groups(ctx: Context) -> Iterator[CandidateGroup]:
    """Candidate groups. Inside a group the search tries the least recompute first,
    each by growing micro-batch; FSDP shard degrees come largest first, so a group
    that runs out of memory rules out the smaller shard degrees after it."""
    req, preset = ctx.request, ctx.preset
    world = ctx.world
    tps = [
        t
        for t in divisors(req.gpus_per_node)
        if t <= ctx.sku.nvlink_domain
        and preset.num_attention_heads % t == 0
        and preset.num_key_value_heads % t == 0
    ]
    cps = [
        c
        for c in (1, 2, 4, 8, 16)
        if c == 1 or (ctx.seq_len % (2 * c) == 0 and ctx.seq_len // c >= MIN_CP_CHUNK_TOKENS)
    ]
    if req.precision == "auto":
        precisions: list[Precision] = [ctx.sku.default_precision]
        if ctx.sku.supports_fp8 and ctx.sku.default_precision != "fp32":
            precisions.append("fp8")
    else:
        precisions = [req.precision]
    acs: tuple[ActivationCheckpointing, ...] = (
        ("none", "selective", "full")
        if req.activation_checkpointing == "auto"
        else (req.activation_checkpointing,)
    )
    seqs = max(1, ctx.sequences)
    for tp, cp in itertools.product(tps, cps):
        if world % (tp * cp):
            continue
        for pp in divisors(world // (tp * cp)):
            # A tied head is the embedding's parameter: it cannot go on another stage.
            if pp > preset.num_hidden_layers or (pp > 1 and preset.tie_word_embeddings):
                break
            dp = world // (tp * cp * pp)
            schedules: list[tuple[PipelineSchedule, int]] = [("1F1B", 1)]
            if pp > 1:
                schedules += [
                    ("Interleaved1F1B", v)
                    for v in (2, 4, 8)
                    if v <= MAX_VIRTUAL_STAGES and pp * v <= preset.num_hidden_layers
                ]
            local = seqs // dp if seqs % dp == 0 else 0
            mbs = tuple(m for m in divisors(local) if m <= MAX_MICRO_BATCH) if local else (1,)
            shards = sorted(
                (
                    d
                    for d in _shard_options(dp, tp * cp, req.gpus_per_node)
                    if dp // d >= req.min_replica_groups
                ),
                reverse=True,
            )
            for (sched, v), prec, dp_shard in itertools.product(schedules, precisions, shards):
                yield CandidateGroup(tp, cp, pp, sched, v, prec, dp_shard, dp // dp_shard, mbs, acs)


def speed_bound(ctx: Context, g: CandidateGroup, stage_layers: tuple[int, ...]) -> float:
    """Tokens/s no layout of the group can beat: no recompute, no FSDP or replica
    traffic, and per component the better of the smallest and largest micro-batch
    (large ones run GEMMs faster, small ones shrink the pipeline bubble)."""
    parts = []
    for mb in {g.micro_batches[0], g.micro_batches[-1]}:
        accum = max(1, ctx.sequences // (g.dp_shard * g.dp_replicate * mb))
        parts.append(
            step_time(
                StepInputs(
                    ctx.preset,
                    ctx.sku,
                    ctx.fabric,
                    ctx.request.gpus_per_node,
                    ctx.seq_len,
                    g.tp,
                    g.cp,
                    1,
                    1,
                    stage_layers,
                    g.virtual,
                    mb,
                    accum,
                    "none",
                    g.precision,
                    0.0,
                )
            )
        )
    floor = (
        min(p.compute for p in parts)
        + min(p.pp_bubble for p in parts)
        + min(p.tp_comm for p in parts)
        + min(p.cp_comm for p in parts)
    )
    return ctx.request.global_batch_tokens / floor


def state_gib(ctx: Context, g: CandidateGroup, stage_layers: tuple[int, ...]) -> float:
    """GiB of fp32 weights, gradients and AdamW moments on the fullest rank."""
    pp = len(stage_layers)
    params = max(
        rank_params(ctx.preset, stage_layers[r], g.tp, r == 0, r == pp - 1)
        for r in {0, pp - 1, stage_layers.index(max(stage_layers))}
    )
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
