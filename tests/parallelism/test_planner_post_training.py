"""A post-training objective is planned like a phase: the memory of an SFT or DPO
objective on the engine (policy, AdamW, activations at the recipe's max_length, no
resident DPO reference, the objective-end scoring copy) and its refusal at submit. GPUs are modelled
from configs/; nothing here needs one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.manifests import example_manifest

from orchestrator.gates.manifest import Manifest
from orchestrator.gates.planning import plan_manifest
from stages.errors import ErrorCode, ItoError
from stages.parallelism.memory import GIB
from stages.parallelism.post_training import check_objective_memory, objective_memory
from stages.presets import load_model_preset

_DATA = {
    "uri": "file:///d/x.jsonl",
    "sha256": "1" * 64,
    "provenance": {"source": "t", "license": "MIT"},
}


def _mem(kind: Any = "dpo", batch: int = 8, length: int = 4096, groups: int = 8) -> Any:
    return objective_memory(
        load_model_preset("llama-1b"),
        kind=kind,
        batch_size=batch,
        max_length=length,
        replica_groups=groups,
    )


def test_the_policy_and_adamw_are_fp32_and_the_dpo_reference_is_not_resident() -> None:
    params = load_model_preset("llama-1b").num_params
    dpo, sft = _mem("dpo").training, _mem("sft").training
    # One model: no reference copy beside the policy.
    assert dpo.weights == sft.weights == pytest.approx(params * 4, rel=1e-5)
    assert dpo.optimizer == 2 * dpo.weights
    # A DPO pair is two sequences in one forward: the memory of twice the SFT rows.
    assert dpo.total == pytest.approx(_mem("sft", batch=16).training.total)
    assert dpo.total > sft.total


def test_activations_grow_with_max_length_and_shrink_with_more_groups() -> None:
    short, long = _mem(length=2048).training, _mem(length=8192).training
    assert long.activations > 3.5 * short.activations
    assert _mem(length=2048, groups=8).peak < _mem(length=2048, groups=2).peak


def test_the_objective_end_scoring_holds_a_base_copy_beside_the_policy_and_adamw() -> None:
    params = load_model_preset("llama-1b").num_params
    m = _mem()
    assert m.scoring > m.training.weights + m.training.optimizer + params * 4
    assert m.peak == max(m.training.total, m.scoring)


def test_an_infeasible_objective_is_refused_with_the_planners_code() -> None:
    with pytest.raises(ItoError) as e:
        check_objective_memory(
            load_model_preset("llama3-8b"),  # 16 B/param of fp32 state: 120 GiB > 80
            objective="dpo",
            batch_size=8,
            max_length=1024,
            replica_groups=8,
            device_memory_gib=80,
            memory_utilization=0.9,
        )
    assert e.value.code is ErrorCode.plan_out_of_memory
    assert e.value.message.startswith("post_training.dpo: predicted peak")
    peak = e.value.details["peak_memory_gib"]
    assert e.value.details["objective"] == "dpo" and isinstance(peak, float) and peak > 72
    fits = check_objective_memory(
        load_model_preset("llama-1b"),
        objective="dpo",
        batch_size=8,
        max_length=1024,
        replica_groups=8,
        device_memory_gib=80,
        memory_utilization=0.9,
    )
    assert fits.peak / GIB < 72


def test_submit_planning_refuses_an_objective_that_does_not_fit_the_booking(tmp_path: Path) -> None:
    booking = {"gpu_sku": "cpu-testbed", "gpus_per_node": 2, "node_count": 1, "fabric": "loopback"}

    def planned(max_length: int) -> Any:
        m = example_manifest(
            tmp_path,
            post_training={
                "sft": {"data": _DATA, "steps": 2, "batch_size": 4, "max_length": 64},
                "dpo": {"data": _DATA, "steps": 2, "batch_size": 4, "max_length": max_length},
            },
        )
        return plan_manifest(Manifest.model_validate(m), booking)

    assert planned(64).refusal is None and planned(64).plan is not None
    # The testbed's 8 GiB "GPU": llama-tiny's logits at 2^20 tokens alone exceed it.
    refused = planned(1 << 20)
    assert refused.plan is None and refused.refusal is not None
    assert refused.refusal["code"] == "plan_out_of_memory"
    assert "post_training.dpo" in refused.refusal["message"]


def test_the_rlvr_objective_is_sized_by_its_groups_and_lengths_and_a_kl_reference() -> None:
    """The learner's optimizer step: groups x group size sequences at prompt +
    completion length over the replica groups; with a KL term the frozen reference's
    fp32 copy is resident the whole objective."""
    preset = load_model_preset("llama-1b")

    def rlvr(batch: int, length: int, reference: bool = False) -> Any:
        return objective_memory(
            preset,
            kind="rlvr",
            batch_size=batch,
            max_length=length,
            replica_groups=4,
            resident_reference=reference,
        )

    base = rlvr(32, 768)
    # The same sequences as an SFT batch of that many rows: one model, no pairs.
    assert base.peak == _mem("sft", batch=32, length=768, groups=4).peak
    assert rlvr(64, 768).training.activations > 1.9 * base.training.activations
    assert rlvr(32, 1536).training.activations > 1.9 * base.training.activations
    with_kl = rlvr(32, 768, reference=True)
    assert with_kl.reference == pytest.approx(preset.num_params * 4, rel=1e-5)
    assert with_kl.peak == pytest.approx(base.peak + with_kl.reference)


def test_submit_planning_refuses_an_rlvr_objective_that_does_not_fit(tmp_path: Path) -> None:
    booking = {"gpu_sku": "cpu-testbed", "gpus_per_node": 2, "node_count": 1, "fabric": "loopback"}

    def planned(max_completion_tokens: int, beta: float = 0.0) -> Any:
        rlvr = {
            "data": _DATA,
            "steps": 2,
            "group_size": 4,
            "groups_per_step": 2,
            "max_completion_tokens": max_completion_tokens,
            "overlong_buffer_tokens": 8,
            "beta": beta,
        }
        m = example_manifest(tmp_path, post_training={"rlvr": rlvr})
        return plan_manifest(Manifest.model_validate(m), booking)

    assert planned(64).refusal is None and planned(64, beta=0.1).plan is not None
    # 8 sequences of 2^20 tokens on the testbed's 8 GiB "GPU": the logits alone exceed it.
    refused = planned(1 << 20, beta=0.1)
    assert refused.plan is None and refused.refusal is not None
    assert refused.refusal["code"] == "plan_out_of_memory"
    assert refused.refusal["message"].startswith("post_training.rlvr: predicted peak")
    assert "resident reference" in refused.refusal["message"]


def test_an_objective_shards_over_its_groups_ranks_and_its_batch_must_split_over_them() -> None:
    """The objectives train on the run's groups with their ranks: the plan's TP, and
    FSDP over the rest (its pipeline and context ranks folded in). An 8B policy whose
    fp32 state does not fit one rank fits one group of 8 FSDP ranks; a batch the
    data-parallel ranks cannot split is refused at plan time, not at the objective."""
    from stages.trainer.parallel.layout import ParallelLayout

    folded = ParallelLayout(tp=2, pp=2, cp=2, dp_shard=2).for_post_training()
    assert (folded.tp, folded.pp, folded.cp, folded.dp_shard) == (2, 1, 1, 8)
    assert (folded.precision, folded.activation_checkpointing) == ("fp32", "none")

    def dpo(groups: int, fsdp: int, batch: int = 8) -> Any:
        return check_objective_memory(
            load_model_preset("llama3-8b"),
            objective="dpo",
            batch_size=batch,
            max_length=1024,
            replica_groups=groups,
            fsdp=fsdp,
            device_memory_gib=80,
            memory_utilization=0.9,
        )

    with pytest.raises(ItoError) as e:
        dpo(groups=8, fsdp=1)
    assert e.value.code is ErrorCode.plan_out_of_memory
    sharded = dpo(groups=1, fsdp=8)
    assert sharded.peak / GIB < 72
    # AdamW's two fp32 moments, 8 bytes a parameter, an eighth of them on each rank.
    params = load_model_preset("llama3-8b").num_params
    assert sharded.training.optimizer == pytest.approx(params * 8 / 8, rel=1e-3)
    with pytest.raises(ItoError) as e:
        dpo(groups=1, fsdp=8, batch=4)
    assert e.value.code is ErrorCode.plan_objective_unsupported
    assert e.value.details == {"objective": "dpo", "dp_ranks": 8}


def test_an_objectives_engine_runs_on_the_runs_groups_and_ranks(tmp_path: Path) -> None:
    from stages.post_training.config import SFTConfig
    from stages.post_training.on_engine import objective_train_config
    from stages.trainer.config import TrainStageConfig

    run = TrainStageConfig.model_validate(
        {
            "model": {"preset": "llama-tiny", "size": "tiny"},
            "target": {"max_steps": 2, "seq_len": 32, "global_batch_tokens": 256},
            "checkpoint": {"interval_steps": 10, "storage_uri": f"file://{tmp_path}/c"},
            "replica_groups": 2,
            "ranks_per_group": 4,
            "parallel": {"tp": 2, "pp": 2, "pp_microbatches": 2},
        }
    )
    sft = objective_train_config(
        "sft",
        SFTConfig.model_validate({"data": _DATA, "steps": 3, "batch_size": 4}),
        base=tmp_path / "base",
        data_path=tmp_path / "sft.jsonl",
        checkpoint_dir=tmp_path / "ckpt",
        train=run,
        device="cpu",
    )
    assert (sft.replica_groups, sft.ranks_per_group) == (2, 4)
    assert sft.layout.degrees() == {"pp": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert sft.dp_world == 4
