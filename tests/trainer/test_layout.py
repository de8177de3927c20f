"""The trainer's layout: resolution from the plan, refusals of what a device cannot
run (validation, stage start, worker start), and one-process parallelize."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from stages.errors import ErrorCode, ItoError
from stages.trainer.parallel.layout import (
    ParallelLayout,
    check_runnable,
    check_runnable_on_sku,
    layout_from_plan,
)
from stages.trainer.rank.objective import LanguageModelObjective


@pytest.mark.parametrize(
    ("layout", "device", "capability"),
    [
        (ParallelLayout(cp=2), "cpu", None),
        (ParallelLayout(precision="fp8"), "cpu", None),
        (ParallelLayout(precision="fp8"), "cuda", (8, 0)),  # A100
        (ParallelLayout(precision="fp8"), "cuda", (8, 9)),  # L40S: fp8, but not H100-class
    ],
)
def test_what_the_device_cannot_run_is_refused_with_a_code(
    layout: ParallelLayout, device: str, capability: tuple[int, int] | None
) -> None:
    with pytest.raises(ItoError) as e:
        check_runnable(layout, device, capability)
    assert e.value.code == ErrorCode.layout_unsupported


def test_what_the_device_can_run_passes() -> None:
    check_runnable(ParallelLayout(tp=2, pp=2, precision="bf16"), "cpu")
    check_runnable(ParallelLayout(cp=4, precision="fp8"), "cuda", (9, 0))
    check_runnable_on_sku(ParallelLayout(cp=2, precision="fp8"), "H100-SXM")
    for sku, layout in [
        ("L40S", ParallelLayout(precision="fp8")),
        ("cpu-testbed", ParallelLayout(cp=2)),
    ]:
        with pytest.raises(ItoError):
            check_runnable_on_sku(layout, sku)


def test_layout_resolves_dp_shard_and_refuses_degrees_that_do_not_fit() -> None:
    layout = ParallelLayout(tp=2, pp=2).resolved(8)
    assert layout.dp_shard == 2 and layout.pp_microbatches == 2
    assert layout.coords(5) == {"pp": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    with pytest.raises(ItoError) as e:
        ParallelLayout(tp=2, dp_shard=3).resolved(4)
    assert e.value.code == ErrorCode.plan_degrees_mismatch


def test_pipeline_split_follows_the_plan_or_fills_the_middle_first() -> None:
    assert ParallelLayout(pp=2, pp_stage_layers=[3, 1]).chunk_layers(4) == [(0, 3), (3, 4)]
    assert ParallelLayout(pp=3).stage_layers(7) == [2, 3, 2]
    inter = ParallelLayout(pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2)
    assert inter.chunk_layers(8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ItoError):
        ParallelLayout(pp=2, pp_stage_layers=[2, 2]).stage_layers(5)


def test_the_train_config_takes_the_plan_and_checks_it_against_the_group() -> None:
    from stages.parallelism import PlanRequest, plan
    from tests.trainer.test_engine_loop import _cfg

    chosen = plan(
        PlanRequest(
            model="llama-tiny",
            gpu_sku="cpu-testbed",
            gpus_per_node=4,
            node_count=1,
            fabric="loopback",
            global_batch_tokens=4096,
            seq_len=64,
            min_replica_groups=1,
        )
    )
    layout = layout_from_plan(chosen.model_dump(mode="json"))
    ranks = chosen.tp * chosen.pp * chosen.cp * chosen.dp_shard
    cfg = _cfg(replica_groups=chosen.dp_replicate, ranks_per_group=ranks, parallel=layout)
    assert cfg.layout.degrees() == {
        "pp": chosen.pp,
        "dp_shard": chosen.dp_shard,
        "cp": chosen.cp,
        "tp": chosen.tp,
    }
    with pytest.raises(ValidationError):
        _cfg(ranks_per_group=2, parallel=ParallelLayout(tp=4))
    # TP and PP ranks share their batch: only data-parallel ranks split it.
    assert (
        _cfg(replica_groups=1, ranks_per_group=4, parallel=ParallelLayout(tp=2, pp=2)).micro_batch
        == _cfg(replica_groups=1, ranks_per_group=1).micro_batch
    )


def test_the_stage_refuses_cp_on_cpu_before_any_worker_starts(tmp_path: Path) -> None:
    from stages.base import StageContext
    from stages.trainer.stage import TrainingStage
    from tests.trainer.test_engine_loop import _cfg

    cfg = _cfg(ranks_per_group=2, parallel=ParallelLayout(cp=2))
    ctx = StageContext(
        run_id="r",
        booking_id="b",
        workdir=tmp_path,
        emit=lambda e: None,
        cancel_event=threading.Event(),
    )
    out = TrainingStage(cfg).run(ctx)
    assert out.status == "failed" and out.error_code == ErrorCode.layout_unsupported.value


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_one_rank_applies_recompute_and_bf16_and_reads_them_back(mode: str) -> None:
    from stages.model.lm import build_model, causal_lm_loss
    from stages.presets import load_model_preset
    from stages.trainer.parallel.parallelize import ParallelModel

    preset = load_model_preset("llama-tiny")
    ids = torch.randint(0, preset.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = build_model(preset, seed=0)
    expected = causal_lm_loss(ref, ids)
    expected.backward()
    pm = ParallelModel(
        build_model(preset, seed=0),
        ParallelLayout(activation_checkpointing=mode).resolved(1),
        None,  # type: ignore[arg-type]
        torch.device("cpu"),
    )
    assert pm.built_layout()["activation_checkpointing"] == mode
    loss = pm.forward_backward(LanguageModelObjective.batch_of(ids), LanguageModelObjective(None))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    for (name, p), q in zip(pm.module.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    # the plan's gradient accumulation: same loss and gradients as one pass
    accum = ParallelModel(
        build_model(preset, seed=0), ParallelLayout(grad_accum=2), None, torch.device("cpu")
    )
    assert float(
        accum.forward_backward(LanguageModelObjective.batch_of(ids), LanguageModelObjective(None))
    ) == pytest.approx(float(expected), rel=1e-6)
    for p, q in zip(accum.module.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    bf16 = ParallelModel(
        build_model(preset, seed=0), ParallelLayout(precision="bf16"), None, torch.device("cpu")
    )
    assert bf16.built_layout()["precision"] == "bf16"
    assert next(bf16.module.parameters()).dtype == torch.float32  # fp32 master weights
    assert (
        abs(
            float(
                bf16.forward_backward(
                    LanguageModelObjective.batch_of(ids), LanguageModelObjective(None)
                )
            )
            - float(expected)
        )
        < 0.05
    )


def test_the_planner_never_picks_fp8_where_the_trainer_would_refuse_it() -> None:
    from stages.parallelism import PlanRequest, plan
    from stages.parallelism.planner import validate_layout
    from stages.parallelism.spec import Layout

    req = PlanRequest(
        model="llama3-8b",
        gpu_sku="L40S",
        gpus_per_node=8,
        node_count=4,
        fabric="ib-ndr",
        global_batch_tokens=2**20,
        seq_len=4096,
    )
    assert plan(req).precision != "fp8"
    with pytest.raises(ItoError) as e:
        validate_layout(req, Layout(tp=1, precision="fp8"))
    assert e.value.code == ErrorCode.plan_fp8_unsupported


def test_a_tied_head_is_refused_a_pipeline() -> None:
    """The first stage would hold the embedding and the last the head, one parameter:
    a pipelined layout of a tied model is refused before any split (the planner never
    plans one)."""
    from stages.model.lm import build_model
    from stages.trainer.parallel.pipeline import split_model
    from tests.trainer.parallel_cases import TIED_PRESET

    layout = ParallelLayout(pp=2, pp_microbatches=2, dp_shard=1)
    with pytest.raises(ItoError) as e:
        split_model(build_model(TIED_PRESET, seed=0), layout, 0)
    assert e.value.code == ErrorCode.layout_unsupported
    assert "tied input and output embeddings" in e.value.message
