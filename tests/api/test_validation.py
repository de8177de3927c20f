"""Server-side validation pieces as plain functions: cost model, storage roots."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.manifests import example_manifest

from orchestrator.gates.costing import (
    PostTrainingWork,
    estimate_cost,
    estimate_hours,
    gpu_profile,
    price_per_gpu_hour,
)
from orchestrator.gates.manifest import Manifest
from orchestrator.gates.roots import Roots, check_manifest_paths
from orchestrator.gates.validation import training_tokens
from orchestrator.settings import Settings
from stages.errors import ErrorCode, ItoError


def test_cost_is_6nd_over_gpus_peak_mfu() -> None:
    # 1e9 params x 1e9 tokens x 6 = 6e18 FLOPs; 8 GPUs x 1e15 x 0.5 = 4e15 FLOP/s.
    assert estimate_hours(
        active_params=10**9, tokens=10**9, gpus=8, peak_flops=1e15, mfu=0.5
    ) == pytest.approx(1500 / 3600)
    est = estimate_cost(
        gpus=8,
        usd_per_gpu_hour=3.0,
        tokens=10**9,
        active_params=10**9,
        peak_flops=1e15,
        mfu=0.5,
        remaining_term_h=0.25,
    )
    assert est.total_usd == pytest.approx(8 * 3.0 * 1500 / 3600)
    assert est.incremental_usd == pytest.approx(8 * 3.0 * (1500 / 3600 - 0.25))
    # The planner's step time replaces the FLOP bound when given.
    planned = estimate_cost(
        gpus=8,
        usd_per_gpu_hour=3.0,
        tokens=10**9,
        active_params=10**9,
        peak_flops=1e15,
        mfu=0.5,
        remaining_term_h=10,
        step_time_s=2.0,
        steps=1800,
    )
    assert planned.hours == pytest.approx(1.0) and planned.method == "planner_step_time"
    assert planned.incremental_usd == 0


def test_profiles_and_prices_from_configs() -> None:
    configs = Settings(db_path=Path("/nonexistent")).configs_dir
    assert gpu_profile(configs, "H100-SXM")["memory_gib"] > 0
    assert price_per_gpu_hour(configs, "H100-SXM") > 0
    for bad in ("Z9000", "../models/llama-tiny"):
        with pytest.raises(ItoError) as e:
            gpu_profile(configs, bad)
        assert e.value.code == ErrorCode.gpu_sku_unknown


def test_training_tokens_are_pretraining_and_post_training_is_priced_apart() -> None:
    m = example_manifest()
    base = training_tokens(Manifest.model_validate(m))
    assert base == 50 * 512
    ref = m["data"]["refs"][0]
    m["post_training"] = {"sft": {"data": ref, "steps": 10}}
    assert training_tokens(Manifest.model_validate(m)) == base
    est = estimate_cost(
        gpus=8,
        usd_per_gpu_hour=3.0,
        tokens=10**9,
        active_params=10**9,
        peak_flops=1e15,
        mfu=0.5,
        remaining_term_h=10,
        post_training=PostTrainingWork(learner_flops=4e15 * 3600),
    )
    assert est.post_training_hours == pytest.approx(1.0)
    assert est.hours == pytest.approx(1500 / 3600 + 1.0)


def test_checkpoint_storage_roots(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    data = tmp_path / "data"
    data.mkdir()

    def manifest(storage: Path) -> Manifest:
        m = example_manifest(storage)
        m["data"]["refs"][0]["uri"] = f"file://{data}/train.jsonl"
        return Manifest.model_validate(m)

    roots = Roots(data=(str(data),), checkpoint=(str(allowed),))
    inside = manifest(allowed / "run" / "ckpt")
    check_manifest_paths(inside, roots)
    assert list(allowed.iterdir()) == []  # no probe: nothing created, nothing written
    with pytest.raises(ItoError) as e:
        check_manifest_paths(manifest(tmp_path / "elsewhere"), roots)
    assert e.value.code == ErrorCode.path_outside_root
    # A symlink inside the root pointing outside it is refused, never followed.
    (allowed / "escape").symlink_to(tmp_path)
    with pytest.raises(ItoError) as e:
        check_manifest_paths(manifest(allowed / "escape" / "ckpt"), roots)
    assert e.value.code == ErrorCode.path_outside_root
    assert str(tmp_path) not in e.value.message
    # No roots configured: nothing is allowed (there is no "any path" default).
    with pytest.raises(ItoError) as e:
        check_manifest_paths(inside, Roots((str(data),), ()))
    assert e.value.code == ErrorCode.path_outside_root
