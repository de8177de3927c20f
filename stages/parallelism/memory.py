"""Per-GPU peak memory, after Megatron's accounting and Korthikanti et al. (2022).

State (per parameter, FSDP2 with torchtitan's mixed-precision policy): fp32 master
weights (4 B), fp32 gradients (4 B, ``reduce_dtype=fp32``) and AdamW's two fp32
moments (8 B), all sharded over ``dp_shard x cp`` (torchtitan folds CP into the FSDP
mesh); TP and PP split the layers first.

Activations are counted the way Korthikanti et al. count them (the tensors autograd
saves), but for the model this repo trains (``stages.trainer.llama``: Hugging Face's
Llama op for op, with SDPA/flash attention, SwiGLU MLP, RMSNorm, GQA), so there is no s^2
attention term. Per decoder layer and token, with compute dtype of ``b`` bytes:

* each RMSNorm saves its fp32 input and the normalised tensor in ``b``: (4 + b) h;
  its output is saved by the projections that read it: b h;
* attention saves q, k, v after RoPE and its output: b (2h + 2 kv_dim), plus a
  4-byte log-sum-exp per head;
* the SwiGLU MLP saves gate, SiLU(gate), up and their product: 4 b ffn
  (times experts per token for MoE).

That is ``b (8h + 2 kv + 4 ffn) + 4 (heads + 2)`` for fp32, measured exactly on CPU
with saved-tensor hooks. With TP and sequence parallelism everything is divided by
``tp`` except the two gathered inputs of the column-parallel projections. Selective
(op-level, torchtitan style) recompute keeps the layer input and the matmul and
attention outputs, ``b (5h + 2 kv + 2 ffn) + 4 heads``; full recompute keeps only
the layer input, ``b h / tp``. During the backward one layer is recomputed, so its
activations are live once more. Pipeline ranks hold several micro-batches in flight
(1F1B: ``pp - rank``; interleaved: Megatron's warm-up count; GPipe: all). The loss
holds logits, a contiguous shifted copy, the fp32 copy and fp32 log-probs at once:
12 bytes per vocab entry (``V / tp`` with loss parallelism) per token.

The peak is the largest of three moments: the end of the forward (activations and
the loss live; gradients only if they persist across micro-batches), the end of the
backward with recompute (all gradients, one recomputed layer), and the optimizer
step (gradients plus AdamW's fp32 temporaries: one per local parameter with the
foreach implementation used on GPUs, one per tensor with the CPU loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from stages.parallelism.hardware import Precision
from stages.parallelism.spec import ActivationCheckpointing, PipelineSchedule
from stages.presets import ModelPreset

GIB = float(2**30)
MASTER_BYTES = 4  # fp32 sharded master weights
GRAD_BYTES = 4  # fp32 sharded gradients
OPTIMIZER_BYTES = 8  # AdamW exp_avg + exp_avg_sq in fp32
LOSS_BYTES_PER_LOGIT = 12
DDP_BUCKET_BYTES = 2 * 25 * 2**20  # two in-flight all-reduce buckets of torchft/DDP


def compute_bytes(precision: Precision) -> int:
    """Bytes of an activation element (fp8 keeps bf16 activations between GEMMs)."""
    return 4 if precision == "fp32" else 2


def param_gather_bytes(precision: Precision) -> int:
    """Bytes per parameter of FSDP's unsharded (all-gathered) copy."""
    return {"fp32": 4, "bf16": 2, "fp8": 1}[precision]


def layer_activation_bytes(
    preset: ModelPreset,
    tp: int,
    b: int,
    mode: ActivationCheckpointing,
    sequence_parallel: bool = True,
) -> float:
    """Saved activation bytes of one decoder layer per token (per GPU). Without
    sequence parallel (TP on CPU) the norms and the layer input are replicated."""
    h = preset.hidden_size
    kv = preset.num_key_value_heads * preset.head_dim
    ffn = preset.intermediate_size * max(1, preset.experts_per_token)
    heads = preset.num_attention_heads
    sp = tp if sequence_parallel else 1
    if mode == "full":
        return b * h / sp
    if mode == "selective":
        # layer input (SP-sharded), q/k/v/o and attention outputs, gate and up outputs.
        return b * h / sp + b * (4 * h + 2 * kv + 2 * ffn) / tp + 4 * heads / tp
    norms = 2 * ((4 + b) * h / sp + b * h)
    attention = b * (2 * h + 2 * kv) / tp + 4 * heads / tp
    mlp = 4 * b * ffn / tp
    return norms + attention + mlp + 8 / tp


def in_flight_chunks(
    schedule: PipelineSchedule, pp: int, virtual: int, microbatches: int, rank: int
) -> int:
    """Micro-batch x model-chunk activations rank ``rank`` holds at its peak."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return microbatches * virtual
    if schedule == "Interleaved1F1B":
        # Megatron's warm-up micro-batches for rank r in the interleaved schedule.
        return min((pp - rank - 1) * 2 + (virtual - 1) * pp + 1, microbatches * virtual)
    return min(pp - rank, microbatches)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    rank: int  # the pipeline rank with the peak

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers


@cache
def layer_params(preset: ModelPreset) -> tuple[int, int]:
    return preset.layer_params()


def rank_params(preset: ModelPreset, layers: int, tp: int, first: bool, last: bool) -> float:
    """Parameters one TP x PP rank holds before FSDP sharding."""
    attn, mlp = layer_params(preset)
    embed = preset.vocab_size * preset.hidden_size
    params = layers * (attn + mlp) / tp
    if first:
        params += embed / tp
    if last and not (first and preset.tie_word_embeddings):
        params += embed / tp + preset.hidden_size
    return params


def estimate_memory(
    preset: ModelPreset,
    *,
    seq_len: int,
    micro_batch: int,
    microbatches: int,
    tp: int,
    cp: int,
    fsdp: int,
    dp_replicate: int,
    pp_stage_layers: list[int],
    pp_schedule: PipelineSchedule,
    pp_virtual_stages: int,
    activation_checkpointing: ActivationCheckpointing,
    precision: Precision,
    foreach_optimizer: bool = True,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
) -> MemoryEstimate:
    """Peak memory (bytes) of the busiest pipeline rank. ``fsdp = dp_shard x cp``.
    ``sequence_parallel`` / ``loss_parallel`` False: TP as the CPU trainer runs it
    (replicated norms, logits gathered before the loss)."""
    pp = len(pp_stage_layers)
    b = compute_bytes(precision)
    tokens = micro_batch * seq_len / cp
    per_layer = layer_activation_bytes(preset, tp, b, activation_checkpointing, sequence_parallel)
    full_layer = layer_activation_bytes(preset, tp, b, "none", sequence_parallel)
    attn, mlp = layer_params(preset)
    gather_unit = max(attn + mlp, preset.vocab_size * preset.hidden_size) / tp
    h = preset.hidden_size
    max_tensor = max(preset.vocab_size * h, h * preset.intermediate_size, h * h) / tp
    # In-flight micro-batches fall with the rank, so among ranks with equal layers
    # the lowest one peaks: check the first rank of each layer count, and the last.
    ranks: dict[int, int] = {}
    for rank, layers in enumerate(pp_stage_layers):
        ranks.setdefault(layers, rank)
    best: MemoryEstimate | None = None
    for rank in sorted({0, pp - 1, *ranks.values()}):
        layers = pp_stage_layers[rank]
        first, last = rank == 0, rank == pp - 1
        params = rank_params(preset, layers, tp, first, last) / fsdp
        weights = params * MASTER_BYTES
        grads = params * GRAD_BYTES
        optimizer = params * OPTIMIZER_BYTES
        chunk_layers = layers / pp_virtual_stages
        saved = (
            in_flight_chunks(pp_schedule, pp, pp_virtual_stages, microbatches, rank)
            * chunk_layers
            * per_layer
            * tokens
        )
        if pp > 1 and not first:
            saved += tokens * b * preset.hidden_size / tp  # received activation buffer
        recompute = 0.0
        if activation_checkpointing != "none" and layers:
            recompute = (
                full_layer - per_layer if activation_checkpointing == "selective" else full_layer
            ) * tokens
        vocab = preset.vocab_size / (tp if loss_parallel else 1)
        loss = LOSS_BYTES_PER_LOGIT * tokens * vocab if last else 0.0
        if last and not loss_parallel and tp > 1:
            # the head's local shard and the all-gather's staging copy of the logits
            loss += b * tokens * preset.vocab_size * (1 + 1 / tp)
        if last and pp > 1 and pp_schedule == "GPipe":
            # GPipe runs every forward first: each micro-batch's loss keeps its fp32
            # log-probs until its backward (1F1B schedules run a loss's backward next)
            saved += (microbatches - 1) * 4 * tokens * vocab
        buffers = 0.0
        if fsdp > 1 and pp > 1:
            # PP stages stay unsharded across micro-batches (no reshard after forward,
            # gradient sync on the last micro-batch): the whole stage's unsharded
            # weights and fp32 gradients are resident.
            unsharded = params * fsdp
            buffers += unsharded * (param_gather_bytes(precision) + 4)
        elif fsdp > 1:
            # two unsharded layers in flight (current + prefetch) and one layer's
            # unsharded gradient in b plus its fp32 reduce-scatter input.
            buffers += gather_unit * (2 * param_gather_bytes(precision) + b + 4)
        if dp_replicate > 1:
            buffers += DDP_BUCKET_BYTES
        # Three candidate moments; the breakdown reports the one with the peak.
        # Gradients live through the forward only when they persist across micro-batches.
        resident_grads = grads if microbatches > 1 else 0.0
        phases = [
            (saved + max(loss, recompute), resident_grads, 0.0),  # end of forward
            # last layers of the backward: nearly all gradients exist while the
            # first layer is recomputed on top of its saved input
            (recompute + per_layer * tokens, grads, 0.0),
            # optimizer step: foreach AdamW holds one fp32 temporary per local
            # parameter; the single-tensor loop (CPU) one per largest tensor.
            (0.0, grads, (params if foreach_optimizer else max_tensor / fsdp) * MASTER_BYTES),
        ]
        act, grad_at_peak, temp = max(phases, key=lambda ph: ph[0] + ph[1] + ph[2])
        buffers += temp
        est = MemoryEstimate(weights, grad_at_peak, optimizer, act, buffers, rank)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best
