"""Property: whatever the booking, the search returns a plan that its own checks
accept and that honours every invariant, or a refusal with a plan_* code."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stages.errors import ErrorCode, ItoError
from stages.parallelism import (
    PlanRequest,
    list_fabrics,
    list_gpu_skus,
    load_gpu_sku,
    plan,
    validate_layout,
)
from stages.presets import load_model_preset

MODELS = [
    "llama-tiny",
    "llama-probe-s",
    "llama-150m",
    "llama-1b",
    "llama3-8b",
    "llama3-70b",
    "mixtral-8x7b",
]
PLAN_CODES = {c for c in ErrorCode if c.value.startswith("plan_")}


@st.composite
def requests(draw: st.DrawFn) -> PlanRequest:
    model = draw(st.sampled_from(MODELS))
    context = load_model_preset(model).max_position_embeddings
    seq = draw(st.sampled_from([s for s in (128, 256, 1024, 4096, 8192) if s <= context]))
    gpus, nodes = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 3, 4, 16, 64]))
    # Half the batches divide over every GPU (so plans are possible), half are arbitrary.
    seqs = draw(st.one_of(st.integers(1, 4096), st.integers(1, 16).map(lambda k: k * gpus * nodes)))
    return PlanRequest(
        model=model,
        gpu_sku=draw(st.sampled_from(list_gpu_skus())),
        gpus_per_node=gpus,
        node_count=nodes,
        fabric=draw(st.sampled_from(list_fabrics())),
        global_batch_tokens=seq * seqs,
        seq_len=seq,
        precision=draw(st.sampled_from(["auto", "bf16", "fp8"])),
    )


EXAMPLES = 60


def _request(model: str, sku: str, gpus: int, nodes: int, seq: int, seqs: int) -> PlanRequest:
    return PlanRequest(
        model=model,
        gpu_sku=sku,
        gpus_per_node=gpus,
        node_count=nodes,
        fabric="ib-ndr",
        global_batch_tokens=seq * seqs,
        seq_len=seq,
        precision="auto",
    )


# Bookings that must plan, from a one-core testbed to a 32-GPU 70B run: they pin the
# invariants to real plans whatever seed hypothesis derives from this file's source.
FEASIBLE = [
    _request("llama-tiny", "cpu-testbed", 1, 1, 256, 8),
    _request("llama-1b", "L40S", 8, 1, 1024, 64),
    _request("llama3-8b", "H100-SXM", 8, 1, 4096, 64),
    _request("llama3-8b", "H100-PCIe", 8, 1, 4096, 64),
    _request("llama3-70b", "H200", 8, 4, 4096, 256),
    _request("mixtral-8x7b", "B200", 8, 2, 4096, 128),
]


def test_plans_honour_every_invariant_or_refuse_with_a_plan_code() -> None:
    outcomes: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(requests())
    def check(request: PlanRequest) -> None:
        outcomes.append(_check(request))

    for feasible in FEASIBLE:
        check = example(feasible)(check)
    check()
    # Every feasible booking planned (and passed the invariants); the random draws
    # reached both answers.
    assert outcomes[: len(FEASIBLE)] == ["plan"] * len(FEASIBLE), outcomes
    assert "plan" in outcomes[len(FEASIBLE) :]
    assert "refused" in outcomes


def _check(request: PlanRequest) -> str:
    try:
        p = plan(request)
    except ItoError as err:
        assert err.code in PLAN_CODES, err
        return "refused"
    preset, sku = request.preset(), load_gpu_sku(request.gpu_sku)
    assert p.tp * p.pp * p.cp * p.dp_shard * p.dp_replicate == request.world_size
    assert p.tp <= min(request.gpus_per_node, sku.nvlink_domain)
    assert preset.num_key_value_heads % p.tp == 0
    assert sum(p.pp_stage_layers) == preset.num_hidden_layers
    assert (
        p.micro_batch * p.grad_accum * p.dp_shard * p.dp_replicate * p.seq_len
        == request.global_batch_tokens
    )
    assert p.peak_memory_gib <= p.memory.capacity
    assert p.mfu >= sku.mfu_floor
    assert p.precision != "fp8" or sku.supports_fp8
    assert validate_layout(request, p.layout()).tokens_per_s == p.tokens_per_s
    return "plan"
