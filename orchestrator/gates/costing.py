"""Cost estimate of a run: booked GPUs x price per GPU-hour x estimated hours.

Estimated hours use the 6·N·D rule (forward + backward FLOPs per token of the
active parameters) at an assumed MFU until the planner supplies a measured step
time; ``estimate_cost(step_time_s=...)`` then replaces the FLOP bound.

Post-training is priced from what drives its FLOPs (``PostTrainingWork``), always
as an upper bound, and added to the pretraining hours: SFT and DPO from steps x
batch x max_length, RLVR from every completion its rollout workers may generate
(groups per step, group size, the groups dynamic sampling may drop and regenerate,
max completion tokens) plus the learner's passes over them. Rollouts run at a
lower utilisation (decoding is memory-bound) on at most ``rollout_workers`` of the
booked GPUs while the whole booking is billed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages.errors import ErrorCode, ItoError


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def gpu_profile(configs_dir: Path, sku: str) -> dict[str, Any]:
    """``configs/gpus/<sku>.json``, or ``gpu_sku_unknown``."""
    path = configs_dir / "gpus" / f"{sku}.json"
    if "/" in sku or "\x00" in sku or sku.startswith(".") or not path.is_file():
        raise ItoError(ErrorCode.gpu_sku_unknown, f"unknown GPU SKU {sku!r}")
    return read_json(path)


def gpu_number(profile: dict[str, Any], *names: str) -> float | None:
    """The first positive number under any of ``names`` (profiles evolve; read defensively)."""
    for name in names:
        value = profile.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def gpu_memory_bytes(profile: dict[str, Any]) -> float | None:
    gib = gpu_number(profile, "memory_gib", "hbm_gib", "memory_gb")
    return None if gib is None else gib * 2**30


def gpu_bf16_flops(profile: dict[str, Any]) -> float | None:
    tflops = gpu_number(profile, "bf16_tflops", "peak_bf16_tflops", "bf16_peak_tflops")
    return None if tflops is None else tflops * 1e12


def price_per_gpu_hour(configs_dir: Path, sku: str) -> float:
    prices = read_json(configs_dir / "pricing.json").get("usd_per_gpu_hour", {})
    value = prices.get(sku) if isinstance(prices, dict) else None
    if not isinstance(value, int | float) or value < 0:
        raise ItoError(ErrorCode.gpu_sku_unknown, f"no price for GPU SKU {sku!r}")
    return float(value)


def estimate_hours(
    *, active_params: int, tokens: int, gpus: int, peak_flops: float, mfu: float
) -> float:
    """6·N·D / (GPUs · peak · MFU), in hours."""
    return 6.0 * active_params * tokens / (gpus * peak_flops * mfu) / 3600.0


@dataclass(frozen=True)
class PostTrainingWork:
    """FLOPs of the post-training chain: learner passes run like training, rollout
    generation runs on ``rollout_gpus`` devices at the rollout utilisation."""

    learner_flops: float = 0.0
    rollout_flops: float = 0.0
    rollout_gpus: int = 1

    def hours(self, *, gpus: int, peak_flops: float, mfu: float, rollout_mfu: float) -> float:
        learner = self.learner_flops / (gpus * peak_flops * mfu)
        rollout = self.rollout_flops / (
            max(1, min(self.rollout_gpus, gpus)) * peak_flops * rollout_mfu
        )
        return (learner + rollout) / 3600.0


@dataclass(frozen=True)
class CostEstimate:
    gpus: int
    usd_per_gpu_hour: float
    tokens: int
    hours: float
    total_usd: float
    # Hours past the booking's remaining term, priced at the same rate.
    incremental_usd: float
    method: str
    # The post-training share of ``hours`` (FLOP bound, whatever ``method`` says).
    post_training_hours: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_cost(
    *,
    gpus: int,
    usd_per_gpu_hour: float,
    tokens: int,
    active_params: int,
    peak_flops: float,
    mfu: float,
    remaining_term_h: float,
    step_time_s: float | None = None,
    steps: int | None = None,
    post_training: PostTrainingWork | None = None,
    rollout_mfu: float = 0.1,
) -> CostEstimate:
    """The run's cost; with ``step_time_s`` and ``steps`` (pretraining steps, from the
    planner) the pretraining FLOP bound is replaced by the modelled step time. The
    post-training work is added on top either way."""
    if step_time_s is not None and steps is not None:
        hours, method = step_time_s * steps / 3600.0, "planner_step_time"
    else:
        hours = estimate_hours(
            active_params=active_params, tokens=tokens, gpus=gpus, peak_flops=peak_flops, mfu=mfu
        )
        method = f"6ND at {mfu:.0%} MFU"
    post_hours = (
        0.0
        if post_training is None
        else post_training.hours(gpus=gpus, peak_flops=peak_flops, mfu=mfu, rollout_mfu=rollout_mfu)
    )
    hours += post_hours
    total = gpus * usd_per_gpu_hour * hours
    incremental = gpus * usd_per_gpu_hour * max(0.0, hours - max(0.0, remaining_term_h))
    return CostEstimate(
        gpus,
        usd_per_gpu_hour,
        tokens,
        hours,
        round(total, 6),
        round(incremental, 6),
        method,
        post_hours,
    )


def usage_cost_usd(gpu_hours: float, usd_per_gpu_hour: float) -> float:
    """What a run's GPU-hours cost at its booking's price: the estimate's GPUs x price
    x hours, with the GPUs the run had at each moment (they change at each resize to
    its booking; ``telemetry.goodput``'s ``gpu_hours`` adds them up)."""
    return round(gpu_hours * usd_per_gpu_hour, 6)
