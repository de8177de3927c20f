"""Property: whatever the booking, the search returns a plan that its own checks
accept and that honours every invariant, or a refusal with a plan_* code."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
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

MODELS = ["llama-tiny", "llama-probe-s", "llama-150m", "llama-1b", "llama3-8b", "llama3-70b",
          "mixtral-8x7b"]
PLAN_CODES = {c for c in ErrorCode if c.value.startswith("plan_")}


@st.composite
def requests(draw: st.DrawFn) -> PlanRequest:
    model = draw(st.sampled_from(MODELS))
    context = load_model_preset(model).max_position_embeddings
    seq = draw(st.sampled_from([s for s in (128, 256, 1024, 4096, 8192) if s <= context]))
    return PlanRequest(
        model=model, gpu_sku=draw(st.sampled_from(list_gpu_skus())),
        gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        node_count=draw(st.sampled_from([1, 2, 3, 4, 16, 64])),
        fabric=draw(st.sampled_from(list_fabrics())),
        global_batch_tokens=seq * draw(st.integers(1, 4096)), seq_len=seq,
        precision=draw(st.sampled_from(["auto", "bf16", "fp8"])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_plans_honour_every_invariant_or_refuse_with_a_plan_code(request: PlanRequest) -> None:
    try:
        p = plan(request)
    except ItoError as err:
        assert err.code in PLAN_CODES, err
        return
    preset, sku = request.preset(), load_gpu_sku(request.gpu_sku)
    assert p.tp * p.pp * p.cp * p.dp_shard * p.dp_replicate == request.world_size
    assert p.tp <= min(request.gpus_per_node, sku.nvlink_domain)
    assert preset.num_key_value_heads % p.tp == 0
    assert sum(p.pp_stage_layers) == preset.num_hidden_layers
    assert (p.micro_batch * p.grad_accum * p.dp_shard * p.dp_replicate * p.seq_len
            == request.global_batch_tokens)
    assert p.peak_memory_gib <= p.memory.capacity
    assert p.mfu >= sku.mfu_floor
    assert p.precision != "fp8" or sku.supports_fp8
    assert validate_layout(request, p.layout()).tokens_per_s == p.tokens_per_s
