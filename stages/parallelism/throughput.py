"""Predicted step time, tokens/s and MFU of a layout.

Compute is a roofline per GEMM (``max(flops / (peak x GEMM_EFFICIENCY), bytes /
HBM bandwidth)``), so small GEMMs are memory-bound and fp8 only pays off when the
GEMMs are big: fp8 halves the GEMM time when compute-bound and adds the cost of
casting its inputs. Attention (flash, causal) runs in bf16 at an efficiency that
falls with the key-block length (``attention_efficiency``: CP's ring attention runs
2 x cp blocks of seq / (2 cp) tokens, which is what makes CP cost something);
pointwise ops (norms, RoPE, SiLU, residuals) are HBM-bound, eager in bf16 and fused
(compiled decoder layers, ``COMPILED_POINTWISE_SHARE`` of the eager time) in fp8.

Communication is bandwidth x volume plus latency, with the overlap torchtitan gets:
TP/SP collectives (async TP hides TP_OVERLAP of them), FSDP all-gather and
reduce-scatter prefetched under compute (FSDP_OVERLAP of compute can hide them),
CP's K/V all-gather (exposed: attention waits for it), and torchft's replica
all-reduce after the backward (not hidden; ``stages.parallelism.sync`` weighs it
against DiLoCo's sync every H steps). Pipeline bubbles follow
(pp - 1) / (virtual x microbatches).

MFU uses the model FLOPs of torchtitan: ``6 x (params - embedding) + 12 x layers x
hidden x seq`` per token (recompute is hardware work, not model work).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from stages.parallelism.hardware import Fabric, GpuSku, Precision
from stages.parallelism.memory import compute_bytes, param_gather_bytes
from stages.parallelism.spec import ActivationCheckpointing
from stages.presets import ModelPreset

# Of dense peak, for large GEMMs in a training step (launch gaps, wave quantisation
# and clocks under power capping included), calibrated so Llama-3-shaped models land
# near published H100 figures (torchtitan 8B ~35-40% MFU bf16; Llama 3 405B 38-43%).
GEMM_EFFICIENCY = {"fp32": 0.6, "bf16": 0.6, "fp8": 0.45}
ATTENTION_EFFICIENCY = 0.4  # flash attention (fwd + bwd) vs dense bf16 peak, long blocks
ATTENTION_HALF_BLOCK = 1024  # key-block length at which flash runs at half that
# (short blocks, as CP's ring makes them, leave tensor cores idle in the softmax)
POINTWISE_PASSES = 2  # eager kernels read/write each activation more than once
CP_STEP_OVERHEAD_S = 30e-6  # per CP rank and layer: extra attention/merge kernels
HBM_EFFICIENCY = 0.7
NVLINK_EFFICIENCY = 0.8
NVLINK_LATENCY_S = 10e-6
TP_OVERLAP = 0.3  # share of TP collectives async TP hides
FSDP_OVERLAP = 0.9  # share of compute FSDP's prefetch can hide comm under
SELECTIVE_RECOMPUTE_COST = 0.5  # of the pointwise time, recomputed in the backward
# fp8 layouts run each decoder layer's forward compiled (the trainer's
# ``compile_decoder_layers``: torchao's float8 casts are only fast fused), so inductor
# fuses the norms, RoPE, SiLU gating and residual adds that bf16 runs as eager
# kernels: this share of the eager pointwise time is left. Calibrated on one H200
# (docs/training-engine.md, ``benchmarks/gpu_check.py``): llama-1b, micro-batch
# 4 x 2048, one GPU, measured 64,225 tokens/s in fp8 and 44,296 in bf16; charging
# fp8 the eager pointwise time predicted 52,659 (-18%) while bf16 came within
# -1.3%, and the 18% is the eager pointwise time the compiled layers do not spend.
COMPILED_POINTWISE_SHARE = 0.29
# Launch and framework time per layer and micro-batch (~30 kernels x ~10 us, forward
# and backward): what makes many small micro-batches slower than a few large ones.
LAYER_OVERHEAD_S = 3e-4


@dataclass(frozen=True)
class StepTime:
    compute: float
    pp_bubble: float
    tp_comm: float
    cp_comm: float
    fsdp_comm: float
    replicate_comm: float
    pp_comm: float
    optimizer: float

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.pp_bubble
            + self.tp_comm
            + self.cp_comm
            + self.fsdp_comm
            + self.replicate_comm
            + self.pp_comm
            + self.optimizer
        )


def model_flops_per_token(preset: ModelPreset, seq_len: int) -> float:
    embed = preset.vocab_size * preset.hidden_size
    return (
        6 * (preset.active_params - embed)
        + 12 * preset.num_hidden_layers * preset.hidden_size * seq_len
    )


def attention_efficiency(seq_len: int, cp: int) -> float:
    block = seq_len / (2 * cp) if cp > 1 else seq_len
    return (
        ATTENTION_EFFICIENCY
        * block
        / (block + ATTENTION_HALF_BLOCK)
        * (1 + ATTENTION_HALF_BLOCK / 8192)
    )  # normalised: an 8k block runs at the nominal value


def _gemm_time(m: float, k: float, n: float, sku: GpuSku, precision: Precision) -> float:
    """Forward + backward (3 GEMMs of this shape) on one GPU."""
    flops = 2 * m * k * n
    peak = sku.peak_tflops(precision) * 1e12 * GEMM_EFFICIENCY[precision]
    hbm = sku.hbm_bandwidth_gb_s * 1e9 * HBM_EFFICIENCY
    if precision == "fp8":
        moved = (m * k + k * n) * 1 + m * n * 2 + (m * k + k * n) * 3  # + casts to fp8
    else:
        b = compute_bytes(precision)
        moved = b * (m * k + k * n + m * n)
    return 3 * max(flops / peak, moved / hbm)


@lru_cache(maxsize=4096)
def layer_compute_time(
    preset: ModelPreset,
    tokens: float,
    seq_len: int,
    tp: int,
    cp: int,
    sku: GpuSku,
    precision: Precision,
    ac: ActivationCheckpointing,
) -> float:
    """Seconds of forward + backward (+ recompute) of one decoder layer for ``tokens``
    tokens (the micro-batch on this GPU, after CP) on one GPU."""
    h = preset.hidden_size
    kv = preset.num_key_value_heads * preset.head_dim
    ffn = preset.intermediate_size
    experts = max(1, preset.experts_per_token)
    gemm = (
        _gemm_time(tokens, h, (h + 2 * kv) / tp, sku, precision)
        + _gemm_time(tokens, h / tp, h, sku, precision)
        + experts
        * (
            _gemm_time(tokens, h, 2 * ffn / tp, sku, precision)
            + _gemm_time(tokens, ffn / tp, h, sku, precision)
        )
    )
    attn_precision: Precision = "fp32" if precision == "fp32" else "bf16"
    # causal flash attention: fwd 2 x 2 x s x h / 2 per token, backward 2.5x the forward
    attn_flops = 3.5 * 2 * tokens * seq_len * h / tp
    attention = attn_flops / (
        sku.peak_tflops(attn_precision) * 1e12 * attention_efficiency(seq_len, cp)
    )
    b = compute_bytes(precision)
    pointwise_bytes = POINTWISE_PASSES * 3 * b * tokens * (20 * h + 4 * kv + 5 * ffn * experts) / tp
    pointwise = pointwise_bytes / (sku.hbm_bandwidth_gb_s * 1e9 * HBM_EFFICIENCY)
    if precision == "fp8":
        pointwise *= COMPILED_POINTWISE_SHARE
    total = gemm + attention + pointwise + LAYER_OVERHEAD_S
    if ac == "full":
        total += gemm / 3 + attention / 3.5 + pointwise / 3
    elif ac == "selective":
        total += SELECTIVE_RECOMPUTE_COST * pointwise
    return total


@lru_cache(maxsize=4096)
def head_compute_time(
    preset: ModelPreset, tokens: float, tp: int, sku: GpuSku, precision: Precision
) -> float:
    """Output projection + the lm loss (loss parallel under TP) of one micro-batch
    (the last pipeline rank)."""
    gemm = _gemm_time(
        tokens,
        preset.hidden_size,
        preset.vocab_size / tp,
        sku,
        "bf16" if precision == "fp8" else precision,
    )  # the head stays in bf16
    # the lm loss under loss parallelism: each TP rank's reads its V / tp logits
    loss_bytes = 3 * 12 * tokens * preset.vocab_size / tp
    return gemm + loss_bytes / (sku.hbm_bandwidth_gb_s * 1e9 * HBM_EFFICIENCY)


def _collective(volume: float, group: int, bandwidth_gb_s: float, latency_s: float) -> float:
    """Ring all-gather / reduce-scatter of ``volume`` bytes (the full tensor)."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * volume / (bandwidth_gb_s * 1e9) + latency_s * (group - 1)


def group_bandwidth(
    span: int, gpus_per_node: int, sku: GpuSku, fabric: Fabric
) -> tuple[float, float]:
    """(GB/s per GPU, latency s) of a group whose innermost ``span`` ranks are
    consecutive: inside a node it rides NVLink/PCIe, otherwise the NICs."""
    if span <= gpus_per_node:
        return sku.intra_node_bandwidth_gb_s * NVLINK_EFFICIENCY, NVLINK_LATENCY_S
    return (fabric.inter_node_bandwidth_gb_s_per_gpu * fabric.efficiency, fabric.latency_us * 1e-6)


@dataclass(frozen=True)
class StepInputs:
    preset: ModelPreset
    sku: GpuSku
    fabric: Fabric
    gpus_per_node: int
    seq_len: int
    tp: int
    cp: int
    dp_shard: int
    dp_replicate: int
    pp_stage_layers: tuple[int, ...]
    pp_virtual_stages: int
    micro_batch: int
    microbatches: int
    ac: ActivationCheckpointing
    precision: Precision
    local_params: float  # parameters of the busiest rank before FSDP sharding


def replicate_allreduce(x: StepInputs) -> tuple[float, float]:
    """(bandwidth, latency) seconds of one allreduce of the fp32 gradient shards across
    the replica groups (a DiLoCo pseudo-gradient is the same bytes)."""
    if x.dp_replicate <= 1:
        return 0.0, 0.0
    fsdp = x.dp_shard * x.cp
    # mesh order [pp, dp_replicate, dp_shard, cp, tp]: replicas stride over the rest
    bw, lat = group_bandwidth(x.tp * fsdp * x.dp_replicate, x.gpus_per_node, x.sku, x.fabric)
    shard = x.local_params / fsdp * 4
    return 2 * _collective(shard, x.dp_replicate, bw, 0.0), lat * 2 * x.dp_replicate.bit_length()


def step_time(x: StepInputs) -> StepTime:
    pp = len(x.pp_stage_layers)
    tokens = x.micro_batch * x.seq_len / x.cp
    t_layer = layer_compute_time(x.preset, tokens, x.seq_len, x.tp, x.cp, x.sku, x.precision, x.ac)
    t_head = head_compute_time(x.preset, tokens, x.tp, x.sku, x.precision)
    rank_times = [n * t_layer for n in x.pp_stage_layers]
    rank_times[-1] += t_head
    per_mb = max(rank_times)
    compute = per_mb * x.microbatches
    bubble = 0.0
    if pp > 1:
        bubble = per_mb * (pp - 1) / x.pp_virtual_stages
    b = compute_bytes(x.precision)
    h = x.preset.hidden_size
    busiest_layers = max(x.pp_stage_layers)
    # TP + SP: 4 all-gathers/reduce-scatters forward, 4 backward, per layer (+2 recompute).
    tp_bw, tp_lat = group_bandwidth(x.tp, x.gpus_per_node, x.sku, x.fabric)
    per_collective = _collective(tokens * h * b, x.tp, tp_bw, tp_lat)
    n_tp = 8 + (2 if x.ac == "full" else 0)
    tp_comm = (1 - TP_OVERLAP) * n_tp * per_collective * busiest_layers * x.microbatches
    # The lm loss runs on vocab-sharded logits (loss parallelism): no logits gather,
    # three all-reduces of an fp32 value a token (the max, the sum of exponentials,
    # the target's logit) that the loss waits on, once a micro-batch.
    loss_reduces = 3 * _collective(2 * tokens * 4, x.tp, tp_bw, tp_lat)
    tp_comm += loss_reduces * x.microbatches
    # CP as the trainer runs it (torchtitan's default, and Llama 3's): every layer
    # all-gathers the sequence's K and V before attention and reduce-scatters their
    # gradients after it (plus a re-gather under full recompute). Attention cannot
    # start before the gather, so nothing hides it; with TP x CP beyond a node it
    # crosses the NICs once per layer and micro-batch, forward and backward.
    cp_comm = 0.0
    if x.cp > 1:
        cp_bw, cp_lat = group_bandwidth(x.tp * x.cp, x.gpus_per_node, x.sku, x.fabric)
        kv = x.preset.num_key_value_heads * x.preset.head_dim
        kv_bytes = 2 * x.micro_batch * x.seq_len * kv / x.tp * b  # the whole sequence's
        passes = 3 if x.ac == "full" else 2
        exchange = passes * _collective(kv_bytes, x.cp, cp_bw, cp_lat)
        cp_comm = (exchange + 3 * x.cp * CP_STEP_OVERHEAD_S) * busiest_layers * x.microbatches
    # FSDP over dp_shard x cp: all-gather in forward and backward, reduce-scatter in fp32.
    fsdp = x.dp_shard * x.cp
    fsdp_comm = 0.0
    if fsdp > 1:
        bw, lat = group_bandwidth(x.tp * fsdp, x.gpus_per_node, x.sku, x.fabric)
        pbytes = param_gather_bytes(x.precision)
        gather = _collective(x.local_params * pbytes, fsdp, bw, 0.0)
        reduce = _collective(x.local_params * 4, fsdp, bw, 0.0)
        latency = 3 * busiest_layers * lat * 2 * fsdp.bit_length()
        if pp > 1:
            # With PP, stages stay unsharded after the forward and gradients sync on
            # the last micro-batch only (torch.distributed.pipelining + FSDP2).
            comm = gather + reduce + latency
        else:
            # FSDP2 re-gathers in forward and backward and reduce-scatters per micro-batch.
            comm = (2 * gather + reduce + latency) * x.microbatches
        fsdp_comm = max(0.0, comm - FSDP_OVERLAP * compute)
    # torchft replica groups all-reduce the sharded fp32 gradients after the backward.
    replicate_comm = sum(replicate_allreduce(x))
    # PP p2p: one activation per micro-batch boundary each way, half hidden.
    pp_comm = 0.0
    if pp > 1:
        # neighbouring stages sit one stride of tp x cp x dp apart (PP is outermost)
        stride = x.tp * fsdp * x.dp_replicate
        bw, lat = group_bandwidth(2 * stride, x.gpus_per_node, x.sku, x.fabric)
        p2p = tokens * h / x.tp * b / (bw * 1e9) + lat
        pp_comm = 0.5 * 2 * p2p * (x.pp_virtual_stages * x.microbatches + pp - 1)
    # AdamW reads and writes params, grads and both moments (fp32) once.
    optimizer = 2 * 16 * x.local_params / fsdp / (x.sku.hbm_bandwidth_gb_s * 1e9 * HBM_EFFICIENCY)
    return StepTime(
        compute, bubble, tp_comm, cp_comm, fsdp_comm, replicate_comm, pp_comm, optimizer
    )
