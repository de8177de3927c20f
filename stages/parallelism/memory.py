"""Per-GPU peak memory, after Megatron's accounting and Korthikanti et al. (2022).

State (per parameter, FSDP2 with torchtitan's mixed-precision policy): fp32 master
weights (4 B), fp32 gradients (4 B, ``reduce_dtype=fp32``) and AdamW's two fp32
moments (8 B), all sharded over ``dp_shard x cp`` (torchtitan folds CP into the FSDP
mesh); TP and PP split the layers first.

Activations are counted the way Korthikanti et al. count them (the tensors autograd
saves), but for the model this repo trains (``stages.model.llama``: Hugging Face's
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
activations are live once more, and a layer's backward adds its working set (the
gradients of the SwiGLU product and of one factor, ``2 b ffn``). Pipeline ranks hold
several micro-batches in flight (1F1B: ``pp - rank``; interleaved: Megatron's warm-up
count; GPipe: all), and torch's pipelining keeps each one's stage output, which no
layer saves, until its backward: a residual-stream tensor (``/ tp`` under sequence
parallel) more a token and chunk. Its ``PipelineStage`` also allocates, once and for
every micro-batch of every chunk, a receive buffer for the chunk's input and one for
its output's gradient, kept across steps: ``micro-batches x (receiving + sending
chunks)`` residual tensors of one micro-batch. The last rank also holds the final
norm's saved tensors and the head's input. The loss, per vocab entry and token, at the
start of its backward (the step drops the logits first, as torchtitan does): the fp32
log-probs and the fp32 gradients of nll_loss and log_softmax, 12 bytes (the forward's
logits, fp32 copy and log-probs, ``b + 8``, are fewer); a pipeline schedule keeps the
last stage's output, the logits, until its backward: ``b`` more. Under TP the
trainer runs torchtitan's loss parallelism for the ``lm`` objective: the head leaves
its logits sharded over the vocabulary (``stages.trainer.parallel.transforms.apply_tp``)
and the loss runs under ``loss_parallel()`` on ``V / tp`` of them a token, whose fused
backward holds 16 bytes a logit at its peak (``LOSS_PARALLEL_BYTES_PER_LOGIT``). The
post-training objectives' losses read whole rows (``loss_parallel=False``): their
logits are gathered, every TP rank runs the loss over all ``V`` and also holds its
head's local ``V / tp`` shard.

bf16 without FSDP runs eagerly under ``torch.autocast`` over the fp32 master weights
(``stages.trainer.parallel.parallelize.ParallelModel``), measured on CPU's autocast (the same
weight-cast cache as CUDA's). The residual stream is fp32 (the embedding's output is
fp32 and each residual add promotes the bf16 block output), so each norm saves
``(4 + 4) h`` and full recompute keeps ``4 h``; each projection casts its input
itself (autocast caches only the casts of weights), so q, k, v and gate, up save
five bf16 copies of the norms' outputs instead of two: ``30h + 4 kv + 8 ffn +
4 (heads + 2)`` per layer in all. And the bf16 copy of every linear's weight (2 B
per parameter) is cached by autocast and saved by its matmul from the forward to
the end of the backward. fp8 runs its decoder layers compiled (torchao float8): only
its head and loss get the autocast terms.

The peak is the largest of four moments: the end of the forward (activations and
the loss live; gradients only if they persist across micro-batches), the backward
of the last layer (activations, that layer recomputed, its working set), the end
of the backward (all gradients, one recomputed layer),
and the optimizer step (gradients plus AdamW's fp32 temporaries: one per local
parameter with the foreach implementation used on GPUs, one per tensor with the
CPU loop).
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
# The loss per logit as its backward starts (the step has dropped the logits): fp32
# log-probs (saved by log_softmax) and the fp32 gradients of nll_loss and of
# log_softmax over the vocabulary.
LOSS_BYTES_PER_LOGIT = 12
# The same under loss parallelism (``torch.distributed.tensor.parallel.loss``): its
# fused nll_loss/log_softmax backward computes ``(zeros_like(x) + exp(x)) * grad``
# over the saved fp32 log-probs ``x``: four fp32 tensors of the local logits.
LOSS_PARALLEL_BYTES_PER_LOGIT = 16
# Under autocast each projection casts its input itself (autocast caches only the
# casts of leaf weights): q, k and v save three bf16 copies of the first norm's
# output, gate and up two of the second's.
AUTOCAST_PROJECTION_INPUTS = 5
# Under autocast the bf16 copy of each fp32 linear weight: cached by autocast and
# saved by its matmul, live from the forward until the backward is done.
WEIGHT_CAST_BYTES = 2
# A layer's backward peaks in the SwiGLU product's backward: the product's gradient
# and one factor's (b x ffn each) are live on top of what the layer saved.
BACKWARD_FFN_GRADS = 2
DDP_BUCKET_BYTES = 2 * 25 * 2**20  # two in-flight all-reduce buckets of torchft/DDP


def runs_autocast(precision: Precision, fsdp: int) -> bool:
    """bf16 and fp8 without FSDP run under ``torch.autocast`` over fp32 weights
    (``ParallelModel.autocast``); with FSDP, its mixed-precision policy casts them."""
    return precision != "fp32" and fsdp == 1


def residual_bytes(b: int, autocast: bool) -> int:
    """Bytes of a residual-stream element: under autocast the embedding's output is
    fp32 and each residual add promotes the bf16 block output back to fp32."""
    return 4 if autocast else b


def compute_bytes(precision: Precision) -> int:
    """Bytes of an activation element (fp8 keeps bf16 activations between GEMMs)."""
    return 4 if precision == "fp32" else 2


def param_gather_bytes(precision: Precision) -> int:
    """Bytes per parameter of FSDP's unsharded (all-gathered) copy. fp8 gathers bf16:
    the trainer converts its linears with torchao's default float8 config
    (``enable_fsdp_float8_all_gather`` off), so FSDP's mixed-precision policy gathers
    bf16 weights and float8 casts them at each use."""
    return {"fp32": 4, "bf16": 2, "fp8": 2}[precision]


def layer_activation_bytes(
    preset: ModelPreset,
    tp: int,
    b: int,
    mode: ActivationCheckpointing,
    sequence_parallel: bool = True,
    autocast: bool = False,
) -> float:
    """Saved activation bytes of one decoder layer per token (per GPU). Without
    sequence parallel (TP on CPU) the norms and the layer input are replicated.
    ``autocast``: the layer runs eagerly under autocast (fp32 residual stream, one
    bf16 cast of its input per projection)."""
    h = preset.hidden_size
    kv = preset.num_key_value_heads * preset.head_dim
    ffn = preset.intermediate_size * max(1, preset.experts_per_token)
    heads = preset.num_attention_heads
    sp = tp if sequence_parallel else 1
    r = residual_bytes(b, autocast)
    if mode == "full":
        return r * h / sp
    if mode == "selective":
        # layer input (SP-sharded), q/k/v/o and attention outputs, gate and up outputs.
        return r * h / sp + b * (4 * h + 2 * kv + 2 * ffn) / tp + 4 * heads / tp
    # Each RMSNorm saves its fp32 input and the normalised tensor in the residual's
    # dtype; the projections save the norms' outputs in b (gathered under TP).
    inputs = AUTOCAST_PROJECTION_INPUTS if autocast else 2
    norms = 2 * (4 + r) * h / sp + inputs * b * h
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
    ``sequence_parallel`` False: TP as the CPU trainer runs it (replicated norms and
    layer inputs). ``loss_parallel`` False: an objective whose loss gathers the
    logits over TP (the post-training ones; the ``lm`` objective's does not)."""
    pp = len(pp_stage_layers)
    b = compute_bytes(precision)
    tokens = micro_batch * seq_len / cp
    autocast = runs_autocast(precision, fsdp)
    # fp8's decoder layers are compiled torchao float8 linears: inductor chooses what
    # they save and autocast does not cast their weights, so only bf16 layers get the
    # eager-autocast terms (the head and the loss run eagerly under autocast in both).
    layer_autocast = autocast and precision == "bf16"
    r = residual_bytes(b, autocast)
    sp = tp if sequence_parallel else 1
    per_layer = layer_activation_bytes(
        preset, tp, b, activation_checkpointing, sequence_parallel, layer_autocast
    )
    full_layer = layer_activation_bytes(preset, tp, b, "none", sequence_parallel, layer_autocast)
    attn, mlp = layer_params(preset)
    ffn = preset.intermediate_size * max(1, preset.experts_per_token)
    working = BACKWARD_FFN_GRADS * b * ffn / tp  # per token, during a layer's backward
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
        chunks = in_flight_chunks(pp_schedule, pp, pp_virtual_stages, microbatches, rank)
        saved = chunks * chunk_layers * per_layer * tokens
        if pp > 1:
            # torch.distributed.pipelining keeps each in-flight chunk's output (its
            # ``fwd_cache``) until that chunk's backward, and no layer of the stage saves
            # it. The last model chunk's outputs are the logits, counted with the loss.
            final = (microbatches if pp_schedule == "GPipe" else 1) if last else 0
            saved += max(0, chunks - final) * tokens * r * h / sp
        # torch.distributed.pipelining's PipelineStage allocates, per model chunk and
        # micro-batch, a receive buffer for the chunk's input (all but the first chunk)
        # and one for its output's gradient (all but the last), once, kept across
        # steps. (The input's gradient is sent as its backward ends and not kept.)
        boundary = tokens * r * h / sp  # a residual-stream tensor of one micro-batch
        chunk_ids = [rank + k * pp for k in range(pp_virtual_stages)] if pp > 1 else []
        receiving = sum(1 for c in chunk_ids if c > 0)
        sending = sum(1 for c in chunk_ids if c < pp * pp_virtual_stages - 1)
        stage_io = (receiving + sending) * microbatches * boundary
        if receiving and not (activation_checkpointing == "none" and r < 4):
            # an in-flight chunk's first layer saves the received tensor itself (the
            # layer input, or the norm's fp32 input), already in its buffer
            saved -= chunks * receiving / pp_virtual_stages * boundary
        recompute = 0.0
        if activation_checkpointing != "none" and layers:
            recompute = (
                full_layer - per_layer if activation_checkpointing == "selective" else full_layer
            ) * tokens
        # Under loss parallelism each TP rank's loss spans its V / tp logits; a
        # gathering objective's spans the whole vocabulary.
        vocab_sharded = loss_parallel and tp > 1
        vocab = preset.vocab_size / tp if vocab_sharded else preset.vocab_size
        per_logit = LOSS_PARALLEL_BYTES_PER_LOGIT if vocab_sharded else LOSS_BYTES_PER_LOGIT
        # The step drops its logits before the backward, so the loss's peak is as its
        # backward starts (the forward's b + 8 bytes a logit, b + 12 under loss
        # parallelism, are below it). A pipeline schedule keeps the last stage's
        # output, the logits, until its backward.
        logits = b * tokens * vocab if last and pp > 1 else 0.0
        loss = per_logit * tokens * vocab + logits if last else 0.0
        if last:
            # the final norm's fp32 input and normalised tensor, and the head's input
            saved += tokens * ((4 + r) * h / sp + b * h)
        # autocast's bf16 weight copies: the decoder's linears (bf16 only; not the
        # norms' weights) and the head
        cast_params = layers * (attn + mlp - 2 * h) / tp if layer_autocast else 0.0
        if autocast and last:
            cast_params += preset.vocab_size * h / tp
        casts = WEIGHT_CAST_BYTES * cast_params
        if last and tp > 1 and not loss_parallel:
            # the head's local shard of the logits besides the gathered ones
            loss += b * tokens * preset.vocab_size / tp
        if last and pp > 1 and pp_schedule == "GPipe":
            # GPipe runs every forward first: each micro-batch's loss keeps its fp32
            # log-probs until its backward (1F1B schedules run a loss's backward next)
            saved += (microbatches - 1) * 4 * tokens * vocab
        buffers = stage_io
        if fsdp > 1 and pp > 1:
            # PP stages stay unsharded across micro-batches: torch.distributed.pipelining
            # runs every micro-batch's backward with FSDP's reshard-after-backward and
            # gradient sync off (``PipelineStage.backward_maybe_with_nosync``) and
            # reduce-scatters once after the last (``perform_reduce_grad``), and FSDP2
            # accumulates the unsharded gradients in reduce_dtype (fp32). So the whole
            # stage's gathered weights and fp32 gradients are resident: a stack that
            # reduce-scatters each micro-batch does not hold the gradients.
            unsharded = params * fsdp
            buffers += unsharded * (param_gather_bytes(precision) + 4)
        elif fsdp > 1:
            # two unsharded layers in flight (current + prefetch) and one layer's
            # unsharded gradient in b plus its fp32 reduce-scatter input.
            buffers += gather_unit * (2 * param_gather_bytes(precision) + b + 4)
        if dp_replicate > 1:
            buffers += DDP_BUCKET_BYTES
        # Four candidate moments; the breakdown reports the one with the peak.
        # Gradients live through the forward only when they persist across micro-batches.
        # Under PP with FSDP they persist unsharded (the buffers above): the sharded
        # gradients appear only at the last micro-batch's reduce-scatter, after every
        # backward (torch.distributed.pipelining's REDUCE_GRAD), and at the step.
        pp_fsdp = fsdp > 1 and pp > 1
        resident_grads = grads if microbatches > 1 and not pp_fsdp else 0.0
        backward_grads = 0.0 if pp_fsdp else grads
        # autocast's weight casts live through the forward and the backward, not the step.
        phases = [
            # end of forward: the loss's backward starts on top of every saved tensor
            (saved + loss, resident_grads, casts),
            # the last layer's backward: still every saved tensor, the layer
            # recomputed and its backward's working set
            (saved + recompute + working * tokens + logits, resident_grads, casts),
            # last layers of the backward: nearly all gradients exist while the
            # first layer is recomputed on top of its saved input and runs its
            # backward
            (recompute + (per_layer + working) * tokens + logits, backward_grads, casts),
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
