"""The planner against runs that were measured: Meta's published Llama 3 405B layout
and this repo's one-H200 fp8 measurement (docs/training-engine.md)."""

from __future__ import annotations

from typing import Any

import pytest

from stages.parallelism import Layout, PlanRequest, load_gpu_sku, validate_layout
from stages.parallelism.published import RUNS, assess_published

# benchmarks/gpu_check.py on one H200: llama-1b, micro-batch 4 x 2048, one GPU.
H200_FP8_TOKENS_PER_S = 64_225
H200_BF16_TOKENS_PER_S = 44_296


def _h200_prediction(precision: str) -> float:
    request = PlanRequest(
        model="llama-1b",
        gpu_sku="H200",
        gpus_per_node=1,
        node_count=1,
        fabric="loopback",
        global_batch_tokens=4 * 2048,
        seq_len=2048,
        precision=precision,  # type: ignore[arg-type]
        mfu_floor=0.0,
    )
    layout = Layout(micro_batch=4, dp_shard=1, precision=precision)  # type: ignore[arg-type]
    return validate_layout(request, layout).tokens_per_s


def test_fp8_prediction_matches_the_h200_measurement() -> None:
    # fp8's decoder layers run compiled: charged bf16's eager pointwise time the
    # planner predicted 52,659 tokens/s, 18% under the measurement.
    predicted = _h200_prediction("fp8")
    assert predicted == pytest.approx(H200_FP8_TOKENS_PER_S, rel=0.10)
    # bf16 (eager) keeps its calibration
    assert _h200_prediction("bf16") == pytest.approx(H200_BF16_TOKENS_PER_S, rel=0.05)


def _llama3_405b_at_16k(**overrides: Any) -> PlanRequest:
    """The Llama 3 paper's 405B pre-training request: 16,384 H100 over RoCE, 8k, 16M tokens."""
    return PlanRequest(
        model="llama3-405b",
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=2048,
        fabric="roce",
        global_batch_tokens=16 * 2**20,
        seq_len=8192,
        **overrides,
    )


def test_llama3_405b_published_layout_is_accepted_at_16k_gpus() -> None:
    # Llama 3 paper, table 4: TP8 CP1 PP16 DP128 on 16,384 H100 at 8k, 41% BF16 MFU.
    request = _llama3_405b_at_16k()
    layout = Layout(
        tp=8,
        pp=16,
        cp=1,
        dp_shard=128,
        pp_schedule="Interleaved1F1B",
        pp_virtual_stages=4,
        activation_checkpointing="selective",
        precision="bf16",
    )
    p = validate_layout(request, layout)
    assert p.peak_memory_gib <= p.memory.capacity
    # torch.distributed.pipelining keeps the stage's gathered weights and its fp32
    # gradients unsharded across micro-batches (the buffers); the sharded gradients
    # only exist after the last micro-batch's reduce-scatter, not at the peak.
    assert p.memory.gradients == 0
    assert p.memory.buffers > 0
    assert p.mfu == pytest.approx(0.41, rel=0.15)


def test_published_table_sees_meta_layout_accepted() -> None:
    run = next(r for r in RUNS if r.model == "llama3-405b" and r.nodes == 2048)
    verdict = assess_published(run)
    assert verdict.refusal is None
    assert verdict.prediction is not None
    usable = load_gpu_sku("H100-SXM").memory_gib * 0.9  # the request's default share
    assert verdict.prediction.peak_memory_gib <= usable


def test_fp8_layouts_gather_bf16_weights_under_fsdp() -> None:
    # The trainer converts its linears with torchao's default float8 config
    # (enable_fsdp_float8_all_gather off): FSDP gathers bf16 weights for fp8 layouts,
    # so the PP stage it keeps gathered weighs what bf16's does.
    def buffers(precision: str) -> float:
        request = _llama3_405b_at_16k(precision=precision)
        layout = Layout(
            tp=8,
            pp=16,
            dp_shard=128,
            pp_schedule="Interleaved1F1B",
            pp_virtual_stages=4,
            activation_checkpointing="full",
            precision=precision,  # type: ignore[arg-type]
        )
        return validate_layout(request, layout).memory.buffers

    assert buffers("fp8") == pytest.approx(buffers("bf16"), rel=1e-3)
