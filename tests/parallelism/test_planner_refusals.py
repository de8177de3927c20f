"""Every refusal reached with hand-set degrees (as torchtitan users set them) or by
the search. GPUs and fabrics are modelled from configs/; nothing here needs one."""

from __future__ import annotations

from typing import Any

import pytest

from stages.errors import ErrorCode, ItoError
from stages.parallelism import Layout, PlanRequest, Rejection, plan, validate_layout


def _req(
    model: str = "llama3-8b",
    gpu: str = "H100-SXM",
    per_node: int = 8,
    nodes: int = 1,
    fabric: str = "ib-ndr",
    tokens: int = 2**20,
    seq: int | None = 8192,
    **kw: Any,
) -> PlanRequest:
    return PlanRequest(
        model=model,
        gpu_sku=gpu,
        gpus_per_node=per_node,
        node_count=nodes,
        fabric=fabric,
        global_batch_tokens=tokens,
        seq_len=seq,
        **kw,
    )


def _refusal(request: PlanRequest, layout: Layout) -> ItoError:
    with pytest.raises(ItoError) as info:
        validate_layout(request, layout)
    assert info.value.message and "\n" not in info.value.message
    return info.value


CASES = [
    ("degrees", _req(), Layout(tp=2, dp_shard=2), ErrorCode.plan_degrees_mismatch),
    ("tp-across-nodes", _req(nodes=2), Layout(tp=16, dp_shard=1), ErrorCode.plan_tp_across_nodes),
    (
        "tp-beyond-nvlink",
        _req(gpu="H100-PCIe"),
        Layout(tp=4, dp_shard=2),
        ErrorCode.plan_tp_beyond_nvlink,
    ),
    (
        "heads",
        _req(model="llama-tiny", seq=128, tokens=8192),
        Layout(tp=4, dp_shard=2),
        ErrorCode.plan_heads_not_divisible,
    ),
    (
        "pp-more-stages-than-layers",
        _req(model="llama-tiny", seq=128, tokens=8192),
        Layout(pp=4, dp_shard=2),
        ErrorCode.plan_pp_layers_unbalanced,
    ),
    (
        "pp-head-heavier-than-a-stage",
        _req(nodes=4),
        Layout(pp=32, dp_shard=1),
        ErrorCode.plan_pp_layers_unbalanced,
    ),
    (
        "batch-not-whole-sequences",
        _req(tokens=2**20 + 1),
        Layout(dp_shard=8),
        ErrorCode.plan_batch_not_divisible,
    ),
    (
        "batch-not-divisible-by-dp",
        _req(tokens=12 * 8192),
        Layout(dp_shard=8),
        ErrorCode.plan_batch_not_divisible,
    ),
    (
        "fp8-on-a100",
        _req(gpu="A100-80G"),
        Layout(dp_shard=8, precision="fp8"),
        ErrorCode.plan_fp8_unsupported,
    ),
    ("oom", _req(model="llama3-70b"), Layout(dp_shard=8), ErrorCode.plan_out_of_memory),
    (
        "bubble",
        _req(model="llama3-70b", nodes=8, tokens=8 * 8192),
        Layout(tp=8, pp=8, dp_shard=1, activation_checkpointing="full"),
        ErrorCode.plan_pp_bubble_too_large,
    ),
    (
        "wasteful-more-gpus-than-batch",
        _req(nodes=4, tokens=16 * 8192),
        Layout(dp_shard=32),
        ErrorCode.plan_wasteful,
    ),
    (
        "wasteful-mfu-under-floor",
        _req(nodes=4, fabric="ethernet", mfu_floor=0.2),
        Layout(dp_shard=32, activation_checkpointing="full"),
        ErrorCode.plan_wasteful,
    ),
]


@pytest.mark.parametrize(
    ("request_", "layout", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_refusal_has_its_code(request_: PlanRequest, layout: Layout, code: ErrorCode) -> None:
    assert _refusal(request_, layout).code == code


def test_oom_refusal_names_the_memory_breakdown() -> None:
    err = _refusal(_req(model="llama3-70b"), Layout(dp_shard=8))
    assert "GiB" in err.message and "optimizer" in err.message
    assert float(err.details["peak_memory_gib"]) > 72  # type: ignore[arg-type]


def test_the_same_layout_passes_when_the_bound_is_relaxed() -> None:
    request = _req(model="llama3-70b", nodes=8, tokens=8 * 8192, max_pp_bubble=0.9, mfu_floor=0.0)
    p = validate_layout(request, Layout(tp=8, pp=8, dp_shard=1, activation_checkpointing="full"))
    assert p.pp == 8 and p.step_time.pp_bubble > 0


def test_dp_shard_minus_one_is_inferred() -> None:
    p = validate_layout(_req(nodes=2), Layout(tp=2, dp_shard=-1, activation_checkpointing="full"))
    assert p.dp_shard == 8 and p.tp * p.dp_shard * p.dp_replicate == 16


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("gpu_sku", "H100-NVL-9000", ErrorCode.gpu_sku_unknown),
        ("fabric", "carrier-pigeon", ErrorCode.fabric_unknown),
        ("model", "gpt-5", ErrorCode.model_preset_unknown),
    ],
)
def test_unknown_names_are_refused(field: str, value: str, code: ErrorCode) -> None:
    request = _req().model_copy(update={field: value})
    with pytest.raises(ItoError) as info:
        plan(request)
    assert info.value.code == code


def test_search_refuses_405b_on_one_node_as_out_of_memory_with_ranked_alternatives() -> None:
    with pytest.raises(ItoError) as info:
        plan(_req(model="llama3-405b", tokens=16 * 2**20))
    err = info.value
    assert err.code == ErrorCode.plan_out_of_memory
    rejected = err.details["rejected"]
    assert isinstance(rejected, list) and rejected
    assert [r["rank"] for r in rejected] == list(range(1, len(rejected) + 1))
    assert rejected[0]["code"] == "plan_out_of_memory"
    assert all(r["code"] and r["reason"] for r in rejected)


def test_search_refuses_a_batch_too_small_for_the_booking_as_wasteful() -> None:
    with pytest.raises(ItoError) as info:
        plan(
            _req(
                model="llama-tiny",
                gpu="cpu-testbed",
                per_node=2,
                nodes=64,
                fabric="loopback",
                seq=128,
                tokens=2048,
            )
        )
    assert info.value.code == ErrorCode.plan_wasteful


def test_search_reports_the_refusal_of_the_layouts_that_got_furthest() -> None:
    # Some layouts run out of memory, but those that fit all miss the MFU floor: the
    # MFU refusal says more about the booking than the memory one.
    with pytest.raises(ItoError) as info:
        plan(_req(nodes=4, tokens=64 * 8192, mfu_floor=0.9))
    err = info.value
    assert err.code == ErrorCode.plan_wasteful
    counts = err.details["refusal_counts"]
    assert isinstance(counts, dict) and counts.get("plan_out_of_memory", 0) > 0
    rejected = err.details["rejected"]
    assert isinstance(rejected, list) and rejected[0]["code"] == "plan_wasteful"


def test_memory_beats_batch_size_as_the_reason_when_both_refuse() -> None:
    # 16 sequences on 64 GPUs: wide data parallelism has no batch to use, and every
    # layout narrow enough to use the batch runs out of memory. Memory is the cause.
    with pytest.raises(ItoError) as info:
        plan(_req(model="llama3-405b", nodes=8, tokens=16 * 8192))
    counts = info.value.details["refusal_counts"]
    assert isinstance(counts, dict) and counts.get("plan_wasteful", 0) > 0
    assert info.value.code == ErrorCode.plan_out_of_memory


@pytest.mark.parametrize(
    "request_",
    [
        _req(model="llama3-405b", tokens=16 * 2**20),  # all out of memory
        _req(nodes=4, tokens=64 * 8192, mfu_floor=0.9),  # all wasteful
        _req(model="llama3-70b", nodes=8, tokens=2**23, max_alternatives=30),  # a plan
    ],
    ids=["oom", "wasteful", "plan"],
)
def test_every_rejected_alternative_revalidates_to_its_verdict(request_: PlanRequest) -> None:
    try:
        rows = plan(request_).rejected
    except ItoError as err:
        rejected = err.details["rejected"]
        assert isinstance(rejected, list)
        rows = [Rejection.model_validate(r) for r in rejected]
    assert rows
    for row in rows:
        if row.code is None:
            assert validate_layout(request_, row.degrees).tokens_per_s == row.tokens_per_s
        else:
            with pytest.raises(ItoError) as info:
                validate_layout(request_, row.degrees)
            assert info.value.code == row.code, row
