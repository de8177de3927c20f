"""The search, the stage and the command line, end to end on modelled hardware."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stages.base import Stage, StageContext
from stages.errors import ErrorCode, ItoError
from stages.parallelism import (
    ParallelismConfig,
    ParallelismStage,
    Plan,
    PlanRequest,
    load_gpu_sku,
    plan,
    validate_layout,
)
from stages.run_facts import RunFacts

REPO = Path(__file__).resolve().parents[2]


def _cpu(tokens: int) -> PlanRequest:
    return PlanRequest(
        model="llama-tiny",
        gpu_sku="cpu-testbed",
        gpus_per_node=2,
        node_count=1,
        fabric="loopback",
        global_batch_tokens=tokens,
        seq_len=128,
    )


@pytest.mark.parametrize("tokens", [2048, 4096, 8192])
def test_cpu_testbed_plans_the_demo(tokens: int) -> None:
    p = plan(_cpu(tokens))
    assert (p.tp, p.pp, p.cp) == (1, 1, 1)
    # two torchft replica groups: FSDP over 2 ranks is predicted within the
    # fault-tolerance margin, so the planner buys live recovery with it
    assert (p.dp_shard, p.dp_replicate) == (1, 2)
    assert p.precision == "fp32"
    assert p.micro_batch * p.grad_accum * 2 * 128 == tokens
    assert 0 < p.peak_memory_gib < load_gpu_sku("cpu-testbed").memory_gib


def test_min_replica_groups_is_honoured_or_refused() -> None:
    request = PlanRequest(
        model="llama3-8b",
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=4,
        fabric="ib-ndr",
        global_batch_tokens=2**22,
        seq_len=8192,
        min_replica_groups=4,
    )
    assert plan(request).dp_replicate >= 4
    with pytest.raises(ItoError) as info:
        plan(_cpu(4096).model_copy(update={"min_replica_groups": 4}))
    assert info.value.code == ErrorCode.plan_no_feasible


def test_fault_tolerance_margin_zero_takes_the_fastest() -> None:
    p = plan(_cpu(4096).model_copy(update={"replica_preference_margin": 0.0}))
    assert all(r.tokens_per_s is None or r.tokens_per_s <= p.tokens_per_s for r in p.rejected)


def test_plan_carries_the_documented_fields_and_is_json() -> None:
    p = plan(
        PlanRequest(
            model="llama3-8b",
            gpu_sku="H100-SXM",
            gpus_per_node=8,
            node_count=2,
            fabric="ib-ndr",
            global_batch_tokens=2**21,
            seq_len=8192,
        )
    )
    d = json.loads(p.model_dump_json())
    for key in (
        "tp",
        "pp",
        "pp_schedule",
        "pp_microbatches",
        "cp",
        "dp_shard",
        "dp_replicate",
        "micro_batch",
        "grad_accum",
        "activation_checkpointing",
        "precision",
        "peak_memory_gib",
        "memory",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "reasons",
        "rejected",
    ):
        assert key in d
    assert p.tp * p.pp * p.cp * p.dp_shard * p.dp_replicate == 16
    m = p.memory
    assert m.total == pytest.approx(
        m.weights + m.gradients + m.optimizer + m.activations + m.buffers, abs=0.01
    )
    assert m.total <= m.capacity
    assert p.reasons and p.rejected
    # ranked: feasible alternatives first (slower than the pick), then refusals
    feasible = [r for r in p.rejected if r.code is None]
    assert all(r.tokens_per_s is not None and r.tokens_per_s <= p.tokens_per_s for r in feasible)
    assert [r.rank for r in p.rejected] == list(range(1, len(p.rejected) + 1))
    # the chosen layout re-validates to the same prediction
    again = validate_layout(
        PlanRequest(
            model="llama3-8b",
            gpu_sku="H100-SXM",
            gpus_per_node=8,
            node_count=2,
            fabric="ib-ndr",
            global_batch_tokens=2**21,
            seq_len=8192,
        ),
        p.layout(),
    )
    assert again.tokens_per_s == p.tokens_per_s


def _at_scale(model: Any) -> PlanRequest:
    """1024 nodes of 8 H100s, 16M-token batches of 8k sequences."""
    return PlanRequest(
        model=model,
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=1024,
        fabric="ib-ndr",
        global_batch_tokens=16 * 2**20,
        seq_len=8192,
    )


def test_405b_at_scale_keeps_tp_in_the_node_and_pipelines() -> None:
    p = plan(_at_scale("llama3-405b"))
    assert 1 < p.tp <= 8 and p.pp >= 8
    assert sum(p.pp_stage_layers) == 126
    assert p.peak_memory_gib <= p.memory.capacity
    assert 0.2 < p.mfu < 0.6


def test_no_fp8_on_a_sku_without_it() -> None:
    p = plan(
        PlanRequest(
            model="llama3-8b",
            gpu_sku="A100-80G",
            gpus_per_node=8,
            node_count=1,
            fabric="ib-hdr",
            global_batch_tokens=2**20,
            seq_len=8192,
        )
    )
    assert p.precision == "bf16"


def _ctx(tmp_path: Path, booking: dict[str, object]) -> StageContext:
    facts = RunFacts.model_validate({"booking": booking})
    return StageContext(run_id="r1", booking_id="b1", workdir=tmp_path, facts=facts)


def test_stage_passes_with_the_plan_as_artifact(tmp_path: Path) -> None:
    stage = ParallelismStage(
        ParallelismConfig(model="llama-tiny", global_batch_tokens=4096, seq_len=128)
    )
    assert isinstance(stage, Stage) and stage.name == "parallelism"
    out = stage.run(
        _ctx(
            tmp_path,
            {"gpu_sku": "cpu-testbed", "gpus_per_node": 2, "node_count": 1, "fabric": "loopback"},
        )
    )
    assert out.status == "passed" and out.error_code is None
    p = Plan.model_validate(out.artifacts["plan"])
    assert p.world_size == 2 and out.metrics["peak_memory_gib"] == p.peak_memory_gib


def test_stage_fails_its_gate_with_the_refusal_code(tmp_path: Path) -> None:
    stage = ParallelismStage(
        ParallelismConfig(model="llama3-405b", global_batch_tokens=16 * 2**20, seq_len=8192)
    )
    out = stage.run(
        _ctx(
            tmp_path,
            {"gpu_sku": "H100-SXM", "gpus_per_node": 8, "node_count": 1, "fabric": "ib-ndr"},
        )
    )
    assert out.status == "failed" and not out.passed
    assert out.error_code == "plan_out_of_memory"
    assert out.artifacts["refusal"]["rejected"]


def test_stage_fails_on_an_incomplete_booking(tmp_path: Path) -> None:
    stage = ParallelismStage(ParallelismConfig(model="llama-tiny", global_batch_tokens=4096))
    out = stage.run(_ctx(tmp_path, {"gpu_sku": "cpu-testbed"}))
    assert out.status == "failed" and out.error_code == "booking_incomplete"


def _cli(*args: str) -> tuple[int, dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.parallelism", *args, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_cli_prints_the_plan_envelope() -> None:
    rc, env = _cli(
        "--model",
        "llama3-70b",
        "--gpu",
        "H100-SXM",
        "--gpus-per-node",
        "8",
        "--nodes",
        "8",
        "--fabric",
        "ib-ndr",
        "--global-batch-tokens",
        "8388608",
        "--seq-len",
        "8192",
    )
    assert rc == 0 and env["ok"] is True and env["live_api_contacted"] is False
    data = env["data"]
    assert isinstance(data, dict)
    for key in (
        "tp",
        "pp",
        "cp",
        "dp_shard",
        "dp_replicate",
        "micro_batch",
        "activation_checkpointing",
        "precision",
        "peak_memory_gib",
        "mfu",
        "reasons",
    ):
        assert key in data


def test_cli_prints_the_refusal_envelope() -> None:
    rc, env = _cli(
        "--model",
        "llama3-405b",
        "--gpu",
        "A100-80G",
        "--gpus-per-node",
        "8",
        "--nodes",
        "1",
        "--fabric",
        "roce",
        "--global-batch-tokens",
        "16777216",
    )
    assert rc == 2 and env["ok"] is False
    error = env["error"]
    assert isinstance(error, dict) and error["code"] == "plan_out_of_memory"


def test_importing_the_planner_does_not_import_torch() -> None:
    # the API server plans at request time; it must not pay for torch
    code = "import sys, stages.parallelism; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_long_context_405b_uses_context_parallelism_like_llama3() -> None:
    # Llama 3 405B trained its 128k context stage with CP16 and TP8.
    p = plan(
        PlanRequest(
            model="llama3.1-405b",
            gpu_sku="H100-SXM",
            gpus_per_node=8,
            node_count=1024,
            fabric="ib-ndr",
            global_batch_tokens=16 * 2**20,
            seq_len=131072,
        )
    )
    assert p.tp == 8 and p.cp >= 8
    assert p.peak_memory_gib <= p.memory.capacity


def test_a_tied_head_is_never_pipelined() -> None:
    """With tie_word_embeddings the head is the embedding's parameter, which the first
    and the last pipeline stage cannot share: the booking the untied 405B pipelines
    (above) gets a plan without PP, and no alternative it weighed had PP either."""
    from stages.presets import load_model_preset

    tied = load_model_preset("llama3-405b").model_copy(
        update={"name": "llama3-405b-tied", "tie_word_embeddings": True}
    )
    p = plan(_at_scale(tied))
    assert p.pp == 1 and p.peak_memory_gib <= p.memory.capacity
    assert p.rejected and all(r.degrees.pp == 1 for r in p.rejected)
