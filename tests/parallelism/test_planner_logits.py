"""Terms of the trainer's head and pipeline that the memory and throughput models
count: under TP the lm loss runs on vocab-sharded logits (loss parallelism) while the
post-training objectives gather them, and torch's pipelining keeps each in-flight
chunk's stage output until its backward."""

from __future__ import annotations

import pytest

from stages.parallelism import Layout, PlanRequest, validate_layout
from stages.parallelism.hardware import load_fabric, load_gpu_sku
from stages.parallelism.memory import (
    LOSS_BYTES_PER_LOGIT,
    LOSS_PARALLEL_BYTES_PER_LOGIT,
    MemoryEstimate,
    estimate_memory,
)
from stages.parallelism.post_training import objective_memory
from stages.parallelism.throughput import StepInputs, head_compute_time, step_time
from stages.presets import ModelPreset, load_model_preset


def _estimate(preset: ModelPreset, **kw: object) -> float:
    base: dict[str, object] = dict(
        seq_len=8192,
        micro_batch=1,
        microbatches=1,
        tp=8,
        cp=1,
        fsdp=8,
        dp_replicate=1,
        pp_stage_layers=[preset.num_hidden_layers],
        pp_schedule="1F1B",
        pp_virtual_stages=1,
        activation_checkpointing="full",
        precision="bf16",
    )
    base.update(kw)
    return estimate_memory(preset, **base).activations  # type: ignore[arg-type]


def _vocab_growth(tp: int, **kw: object) -> float:
    # Activations added by a vocabulary twice as large: the loss's bytes over the
    # extra 128,256 logits of each of the 8,192 tokens (the head's input is the same).
    small = load_model_preset("llama3-8b")
    large = small.model_copy(update={"name": "llama3-8b-v256k", "vocab_size": 2 * small.vocab_size})
    return _estimate(large, tp=tp, **kw) - _estimate(small, tp=tp, **kw)


def test_the_lm_loss_under_tp_spans_each_ranks_vocabulary_shard() -> None:
    # Loss parallelism (the trainer's lm objective): the head leaves each TP rank its
    # V / tp logits, and the fused loss backward holds 16 B of each (4 fp32 tensors).
    extra = 8192 * 128256
    assert LOSS_PARALLEL_BYTES_PER_LOGIT == 16
    assert _vocab_growth(8) == pytest.approx(16 * extra / 8)
    # without TP there is no loss_parallel(): aten's kernels, 12 B a logit
    assert _vocab_growth(1) == pytest.approx(LOSS_BYTES_PER_LOGIT * extra)


def test_a_gathering_objective_runs_its_loss_over_the_whole_vocabulary() -> None:
    # SFT, DPO and GRPO take gathered logits: every TP rank holds its head's shard
    # (b V / tp) and runs the loss (12 B a logit) over all V.
    extra = 8192 * 128256
    gathered = _vocab_growth(8, loss_parallel=False)
    assert gathered == pytest.approx((LOSS_BYTES_PER_LOGIT + 2 / 8) * extra)
    # and so the post-training planner counts them (fp32 policy: the shard is 4 B)
    small = load_model_preset("llama3-8b")
    large = small.model_copy(update={"name": "llama3-8b-v256k", "vocab_size": 2 * small.vocab_size})

    def sft(preset: ModelPreset) -> float:
        mem = objective_memory(
            preset, kind="sft", batch_size=8, max_length=8192, replica_groups=1, tp=8
        )
        return mem.training.activations

    tokens = 8 * 8192  # the rank's 8 sequences
    assert sft(large) - sft(small) == pytest.approx(
        (LOSS_BYTES_PER_LOGIT + 4 / 8) * tokens * small.vocab_size
    )


def test_torchtitans_loss_parallel_70b_layout_fits_this_trainer() -> None:
    # torchtitan ran Llama 3 70B at TP8 FSDP32 with 16 sequences of 8k a rank and full
    # recompute (67.6 GiB) with loss parallelism, as this trainer now does: 131k
    # tokens x 16,032 logits x 16 B are 31 GiB of loss, where gathering all 128k
    # logits a token would be ~190 GiB.
    request = PlanRequest(
        model="llama3-70b",
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=32,
        fabric="ib-ndr",
        global_batch_tokens=512 * 8192,
        seq_len=8192,
        mfu_floor=0.0,
    )
    layout = Layout(
        tp=8, dp_shard=32, micro_batch=16, activation_checkpointing="full", precision="fp8"
    )
    assert 50 < validate_layout(request, layout).peak_memory_gib < 72


def test_the_loss_time_splits_over_tp() -> None:
    # The head's matmul and the loss over its logits both split over TP.
    preset, sku = load_model_preset("llama3-8b"), load_gpu_sku("H100-SXM")
    one = head_compute_time(preset, 16384, 1, sku, "bf16")
    eight = head_compute_time(preset, 16384, 8, sku, "bf16")
    assert eight < 1.5 * one / 8


def test_tp_communication_does_not_grow_with_the_vocabulary() -> None:
    # Loss parallelism gathers no logits: a token's loss all-reduces three fp32
    # values over TP, whatever the vocabulary.
    small = load_model_preset("llama3-8b")
    large = small.model_copy(update={"name": "llama3-8b-v256k", "vocab_size": 2 * small.vocab_size})

    def tp_comm(preset: ModelPreset) -> float:
        inputs = StepInputs(
            preset,
            load_gpu_sku("H100-SXM"),
            load_fabric("ib-ndr"),
            8,
            8192,
            8,  # tp
            1,
            8,
            1,
            (preset.num_hidden_layers,),
            1,
            2,
            4,
            "none",
            "bf16",
            1e9,
        )
        return step_time(inputs).tp_comm

    assert tp_comm(large) == pytest.approx(tp_comm(small))
    assert tp_comm(small) > 0


def test_pipeline_ranks_hold_each_in_flight_stage_output() -> None:
    # Under full recompute a layer keeps only its input (b h / tp a token under SP);
    # torch's pipelining also keeps each in-flight micro-batch's stage output (its
    # fwd_cache) until that micro-batch's backward. Rank 0 of a 1F1B PP4 holds
    # min(4, micro-batches) of them: one more micro-batch adds its 8 layer inputs and
    # its stage output. A small vocabulary keeps the loss off the peak.
    def rank0(microbatches: int) -> float:
        est = _pipeline(microbatches, "1F1B", 1, [8, 8, 8, 8])
        assert est.rank == 0
        return est.activations

    preset = load_model_preset("llama3-8b")
    layer_input = 2 * preset.hidden_size / 8 * 4 * 8192
    assert rank0(4) - rank0(3) == pytest.approx(9 * layer_input)


def _pipeline(microbatches: int, schedule: str, virtual: int, stages: list[int]) -> MemoryEstimate:
    preset = load_model_preset("llama3-8b").model_copy(update={"name": "v1k", "vocab_size": 1024})
    return estimate_memory(
        preset,
        seq_len=8192,
        micro_batch=4,
        microbatches=microbatches,
        tp=8,
        cp=1,
        fsdp=8,
        dp_replicate=1,
        pp_stage_layers=stages,
        pp_schedule=schedule,  # type: ignore[arg-type]
        pp_virtual_stages=virtual,
        activation_checkpointing="full",
        precision="bf16",
    )


# one micro-batch's residual stream on a rank: 4 x 8,192 tokens x 4,096 / TP8 x 2 B
BOUNDARY = 4 * 8192 * 4096 / 8 * 2


def test_pipeline_stages_keep_a_receive_buffer_per_micro_batch() -> None:
    # PipelineStage allocates, per chunk and micro-batch, a buffer for the chunk's
    # input (all but the model's first chunk) and one for its output's gradient (all
    # but the last), kept across steps. Rank 0 of PP4 x2 chunks holds model chunks 0
    # and 4: one receiving, two sending. Its in-flight micro-batches are capped by
    # the warm-up (11 chunks), so 8 more micro-batches add only those buffers.
    fewer, more = (
        _pipeline(8, "Interleaved1F1B", 2, [8] * 4),
        _pipeline(16, "Interleaved1F1B", 2, [8] * 4),
    )
    assert fewer.rank == more.rank == 0
    assert fewer.activations == more.activations
    assert more.buffers - fewer.buffers == pytest.approx(8 * 3 * BOUNDARY)


def test_a_received_input_in_flight_is_counted_once() -> None:
    # Under full recompute a chunk's first layer keeps the received tensor itself,
    # which lives in the receive buffer: it is not counted again as an activation.
    # Rank 0 of PP4 x2 chunks (4 layers each) holds chunks 0 and 4; going from 4 to 5
    # micro-batches puts 2 more chunk passes in flight (10 instead of 8), one of each
    # chunk: 2 x (4 layer inputs + the stage output), less chunk 4's received input.
    fewer, more = (
        _pipeline(4, "Interleaved1F1B", 2, [8] * 4),
        _pipeline(5, "Interleaved1F1B", 2, [8] * 4),
    )
    assert fewer.rank == more.rank == 0
    assert more.activations - fewer.activations == pytest.approx(9 * BOUNDARY)
