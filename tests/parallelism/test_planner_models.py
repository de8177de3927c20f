"""The memory and throughput models behave the way the literature says they must."""

from __future__ import annotations

import pytest

from stages.parallelism import Layout, PlanRequest, validate_layout
from stages.parallelism.checks import head_cost_in_layers, split_layers
from stages.parallelism.memory import in_flight_chunks
from stages.presets import load_model_preset


def test_405b_splits_over_16_stages_like_llama3() -> None:
    # Llama 3 405B: 126 layers on 16 stages, first and last stage one layer lighter.
    preset = load_model_preset("llama3-405b")
    ranks, imbalance = split_layers(126, 16, 1, head_cost_in_layers(preset, 8192))
    assert ranks == (7,) + (8,) * 14 + (7,)
    assert imbalance < 0.05


def test_8b_head_is_worth_several_layers() -> None:
    # 128k vocab x 4096 hidden: the output head costs more than two decoder layers,
    # which is why deep pipelines of the 8B are refused as unbalanced.
    assert head_cost_in_layers(load_model_preset("llama3-8b"), 8192) > 2


@pytest.mark.parametrize(
    ("schedule", "virtual", "expected"),
    [
        ("1F1B", 1, [4, 3, 2, 1]),  # rank r holds pp - r micro-batches
        ("GPipe", 1, [8, 8, 8, 8]),  # all micro-batches
        ("Interleaved1F1B", 2, [11, 9, 7, 5]),  # Megatron: 2 (pp - r - 1) + (v - 1) pp + 1
    ],
)
def test_in_flight_micro_batches_per_schedule(
    schedule: str, virtual: int, expected: list[int]
) -> None:
    got = [in_flight_chunks(schedule, 4, virtual, 8, r) for r in range(4)]  # type: ignore[arg-type]
    assert got == expected


def _request(**kw: object) -> PlanRequest:
    base: dict[str, object] = dict(
        model="llama3-70b",
        gpu_sku="H200",
        gpus_per_node=8,
        node_count=8,
        fabric="ib-ndr",
        global_batch_tokens=2**22,
        seq_len=8192,
        mfu_floor=0.0,
        max_pp_bubble=0.9,
    )
    base.update(kw)
    return PlanRequest.model_validate(base)


def test_recompute_trades_memory_for_time() -> None:
    plans = {
        ac: validate_layout(_request(), Layout(tp=8, dp_shard=8, activation_checkpointing=ac))
        for ac in ("none", "selective", "full")
    }
    assert (
        plans["none"].memory.activations
        > plans["selective"].memory.activations
        > plans["full"].memory.activations
    )
    assert plans["none"].step_time_s < plans["selective"].step_time_s < plans["full"].step_time_s


def test_sharding_tp_and_pp_cut_memory_per_gpu() -> None:
    request = _request(model="llama3-8b")

    def peak(layout: Layout) -> float:
        return validate_layout(request, layout).peak_memory_gib

    fsdp = peak(Layout(tp=1, dp_shard=64, activation_checkpointing="full"))
    assert fsdp < peak(Layout(tp=1, dp_shard=8, dp_replicate=8, activation_checkpointing="full"))
    assert peak(Layout(tp=8, dp_shard=8, activation_checkpointing="none")) < peak(
        Layout(tp=2, dp_shard=32, activation_checkpointing="none")
    )
    # PP halves the layers a rank holds. Not under full recompute: there the loss over
    # the vocabulary dominates, and a pipeline keeps the last stage's logits until its
    # backward (a plain step drops them), which outweighs the halved layers.
    assert peak(Layout(tp=8, pp=2, dp_shard=4, activation_checkpointing="selective")) < peak(
        Layout(tp=8, pp=1, dp_shard=4, dp_replicate=2, activation_checkpointing="selective")
    )


def test_slower_fabric_costs_replica_and_fsdp_time() -> None:
    layout = Layout(tp=8, dp_shard=4, dp_replicate=2, activation_checkpointing="full")
    fast = validate_layout(_request(), layout)
    slow = validate_layout(_request(fabric="ethernet"), layout)
    assert slow.step_time.replicate_comm > 10 * fast.step_time.replicate_comm
    assert slow.step_time_s > fast.step_time_s


def test_more_micro_batches_shrink_the_bubble() -> None:
    def bubble(tokens: int) -> float:
        p = validate_layout(
            _request(global_batch_tokens=tokens),
            Layout(tp=8, pp=4, dp_shard=2, activation_checkpointing="full"),
        )
        return p.step_time.pp_bubble / p.step_time_s

    assert bubble(2**22) < bubble(2**19) < bubble(2**17)
