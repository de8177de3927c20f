"""Server-side validation of a manifest against a booking, before any run exists.

Checks run in a fixed order and the first failure is raised with its own code:
model preset, GPU SKU, fabric, capacity, data policy, checkpoint storage, cost,
curriculum, the pinned sync of the replica groups.
Nothing here writes the store or the file system (no probe file): paths are only
walked, read-only, inside the account's roots (orchestrator/gates/roots.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypedDict
from urllib.parse import urlsplit

from orchestrator.gates.costing import (
    CostEstimate,
    PostTrainingWork,
    estimate_cost,
    gpu_bf16_flops,
    gpu_memory_bytes,
    gpu_profile,
    price_per_gpu_hour,
)
from orchestrator.gates.curriculum import curriculum_report, curriculum_schedule
from orchestrator.gates.manifest import Manifest
from orchestrator.gates.planning import check_sync_pin, rollout_gpus_per_node, trainer_gpus
from orchestrator.gates.roots import (
    Roots,
    allowed_roots,
    check_manifest_paths,
    check_post_training_digests,
)
from orchestrator.settings import Settings
from stages.data_prep.evals import list_eval_suites
from stages.errors import ErrorCode, ItoError
from stages.presets import load_model_preset

# Weights (bf16 2) + grads (bf16 2) + Adam m, v and an fp32 master copy (12).
BYTES_PER_PARAM = 16
PRESET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def training_tokens(m: Manifest) -> int:
    """Pretraining tokens (post-training is priced by ``post_training_work``)."""
    t = m.training
    return t.target_tokens if t.target_tokens is not None else t.steps * t.global_batch_tokens


# FLOPs per token per active parameter: a forward pass is 2, forward + backward 6.
FORWARD, TRAIN = 2.0, 6.0


def post_training_work(m: Manifest, active_params: int) -> PostTrainingWork:
    """Upper bounds of the post-training chain's FLOPs, from the recipe's own sizes."""
    p, n = m.post_training, float(active_params)
    learner = rollout = 0.0
    workers = 1
    if p.sft is not None:
        learner += TRAIN * n * p.sft.steps * p.sft.batch_size * p.sft.max_length
    if p.dpo is not None:
        # Policy forward + backward and the frozen reference's forward, on the chosen
        # and the rejected sequence of every pair.
        pair_tokens = 2 * p.dpo.steps * p.dpo.batch_size * p.dpo.max_length
        learner += (TRAIN + FORWARD) * n * pair_tokens
    if p.rlvr is not None:
        r = p.rlvr
        trained = r.steps * r.groups_per_step * r.group_size * r.max_completion_tokens
        # Dynamic sampling may drop (and so regenerate) up to this many groups a step.
        dropped = r.max_dropped_groups_per_step if r.dynamic_sampling else 0
        generated = r.steps * (r.groups_per_step + dropped) * r.group_size * r.max_completion_tokens
        rollout += FORWARD * n * generated
        # The learner's update, the proximal policy's log-probs (decoupled correction)
        # and the reference's when a KL term is on.
        per_token = (
            TRAIN
            + (FORWARD if r.is_correction == "decoupled" else 0.0)
            + (FORWARD if r.beta > 0 else 0.0)
        )
        learner += per_token * n * trained
        workers = r.rollout_workers
    return PostTrainingWork(learner_flops=learner, rollout_flops=rollout, rollout_gpus=workers)


class CapacityCheck(TypedDict):
    """What the capacity check found: the model's size and the memory it needs, and
    what the booking has."""

    params: int
    active_params: int
    required_gib: float
    booked_gib: float
    gpus: int


def check_rollout_gpus(m: Manifest, booking: dict[str, Any]) -> None:
    """RLVR's rollout workers, a GPU each on a GPU booking, leave the trainer at least
    one GPU on every node (``planning.rollout_gpus_per_node``)."""
    held = rollout_gpus_per_node(m, booking)
    if held and trainer_gpus(m, booking) < 1:
        raise ItoError(
            ErrorCode.rollout_gpus_insufficient,
            f"post_training.rlvr.rollout_workers: {held} GPU(s) of each node's "
            f"{booking['gpus_per_node']} for the rollout workers leave the trainer none",
        )


def check_capacity(m: Manifest, booking: dict[str, Any], profile: dict[str, Any]) -> CapacityCheck:
    preset = load_model_preset(m.model.preset)
    if preset.architecture != m.model.architecture:
        raise ItoError(
            ErrorCode.manifest_invalid,
            f"model.architecture {m.model.architecture} != preset's {preset.architecture}",
        )
    gpus = int(booking["gpus_per_node"]) * int(booking["node_count"])
    per_gpu = gpu_memory_bytes(profile)
    if per_gpu is None:
        raise ItoError(
            ErrorCode.gpu_sku_unknown, f"GPU profile {booking['gpu_sku']} has no memory size"
        )
    need, have = BYTES_PER_PARAM * preset.num_params, per_gpu * gpus
    if need > have:
        raise ItoError(
            ErrorCode.capacity_insufficient,
            f"{preset.name} needs ~{need / 2**30:.1f} GiB for weights, grads and "
            f"optimizer state; the booking has {have / 2**30:.1f} GiB on {gpus} GPUs",
        )
    return {
        "params": preset.num_params,
        "active_params": preset.active_params,
        "required_gib": round(need / 2**30, 3),
        "booked_gib": round(have / 2**30, 3),
        "gpus": gpus,
    }


def check_fabric(settings: Settings, fabric: str) -> None:
    path = settings.configs_dir / "fabrics" / f"{fabric}.json"
    if "/" in fabric or "\x00" in fabric or fabric.startswith(".") or not path.is_file():
        raise ItoError(ErrorCode.fabric_unknown, f"unknown fabric {fabric!r}")


def _scheme(uri: str) -> str:
    try:
        return urlsplit(uri).scheme.lower()
    except ValueError:  # e.g. an unbalanced IPv6 bracket
        return ""


def check_data_policy(settings: Settings, m: Manifest) -> int:
    refs = m.data_refs()
    for where, ref in refs:
        scheme = _scheme(ref.uri)
        if scheme not in settings.allowed_data_schemes:
            raise ItoError(
                ErrorCode.data_scheme_not_allowed,
                f"{where}: scheme {scheme or '(none)'}:// is not allowed; allowed: "
                + ", ".join(f"{s}://" for s in settings.allowed_data_schemes),
            )
        if not (ref.provenance.source.strip() and ref.provenance.license.strip()):
            raise ItoError(ErrorCode.data_provenance_missing, f"{where}: provenance is empty")
    for i, uri in enumerate(m.data.eval_files):
        if _scheme(uri) not in settings.allowed_data_schemes:
            raise ItoError(
                ErrorCode.data_scheme_not_allowed, f"data.eval_files[{i}]: scheme not allowed"
            )
    return len(refs)


def check_names(m: Manifest) -> None:
    """Names that pick files on the server are checked against what exists, before a
    confirmation is spent (a path-shaped name never reaches a loader)."""
    known = set(list_eval_suites())
    for i, name in enumerate(m.data.eval_suites):
        if name not in known:
            raise ItoError(
                ErrorCode.eval_suite_unknown,
                f"data.eval_suites[{i}] is not a known suite; known: " + ", ".join(sorted(known)),
            )
    rung = m.data.ladder_probe.rung_preset
    if not PRESET_NAME.match(rung):
        raise ItoError(
            ErrorCode.model_preset_unknown, "data.ladder_probe.rung_preset is not a preset name"
        )
    load_model_preset(rung)


def estimate_run_cost(
    settings: Settings,
    m: Manifest,
    booking: dict[str, Any],
    profile: dict[str, Any],
    remaining_term_h: float,
    step_time_s: float | None = None,
) -> CostEstimate:
    preset = load_model_preset(m.model.preset)
    peak = gpu_bf16_flops(profile)
    if peak is None:
        raise ItoError(
            ErrorCode.gpu_sku_unknown, f"GPU profile {booking['gpu_sku']} has no bf16 peak"
        )
    return estimate_cost(
        gpus=int(booking["gpus_per_node"]) * int(booking["node_count"]),
        usd_per_gpu_hour=price_per_gpu_hour(settings.configs_dir, booking["gpu_sku"]),
        tokens=training_tokens(m),
        active_params=preset.active_params,
        peak_flops=peak,
        mfu=settings.assumed_mfu,
        remaining_term_h=remaining_term_h,
        step_time_s=step_time_s,
        steps=m.training.steps if step_time_s is not None else None,
        post_training=post_training_work(m, preset.active_params),
        rollout_mfu=settings.assumed_rollout_mfu,
    )


def _check_budget(m: Manifest, cost: CostEstimate) -> None:
    if not math.isfinite(cost.total_usd):
        raise ItoError(ErrorCode.budget_exceeded, "the cost estimate is not finite")
    if cost.total_usd > m.budget.ceiling_usd:
        raise ItoError(
            ErrorCode.budget_exceeded,
            f"estimated cost ${cost.total_usd:,.2f} exceeds the budget ceiling "
            f"${m.budget.ceiling_usd:,.2f}",
        )


def _cost(
    settings: Settings,
    m: Manifest,
    booking: dict[str, Any],
    profile: dict[str, Any],
    remaining_term_h: float,
    step_time_s: float | None,
) -> CostEstimate:
    try:
        return estimate_run_cost(settings, m, booking, profile, remaining_term_h, step_time_s)
    except OverflowError:
        raise ItoError(
            ErrorCode.budget_exceeded,
            "the cost estimate overflows: the training target is absurdly large",
        ) from None


def validate(
    settings: Settings,
    m: Manifest,
    booking: dict[str, Any],
    remaining_term_h: float,
    planner: Callable[[], float | None] | None = None,
    roots: Roots | None = None,
) -> tuple[dict[str, Any], CostEstimate]:
    """All server-side checks; returns (report, cost) or raises the first failure.

    ``planner`` (run after the other checks, before cost) raises the planner's refusal
    or returns the planned step time, which then replaces the FLOP bound of the cost.
    The FLOP-bound cost is checked against the budget before the planner runs, so an
    absurd request is refused before any search. ``roots`` are the account's
    (``Roots()`` with nothing in it when not given: every path is refused)."""
    roots = roots if roots is not None else Roots((), ())
    if not PRESET_NAME.match(m.model.preset):
        raise ItoError(ErrorCode.model_preset_unknown, "model.preset is not a preset name")
    load_model_preset(m.model.preset)
    profile = gpu_profile(settings.configs_dir, booking["gpu_sku"])
    check_fabric(settings, booking["fabric"])
    capacity = check_capacity(m, booking, profile)
    check_names(m)
    n_refs = check_data_policy(settings, m)
    check_manifest_paths(m, roots)
    storage = m.checkpoint.storage_path
    if m.post_training.objectives():
        from stages.pathfields import field_spec
        from stages.post_training.config import PostTrainingConfig
        from stages.post_training.stage import validate_recipe

        check_post_training_digests(m)
        # Formats, digests, reward name, base model: clear codes, read by the safe walk.
        spec = field_spec(PostTrainingConfig, "base_model")
        assert spec is not None
        validate_recipe(
            m.post_training, data_roots=roots.data, model_roots=allowed_roots(spec, roots)
        )
        check_rollout_gpus(m, booking)
    _check_budget(m, _cost(settings, m, booking, profile, remaining_term_h, None))
    step_time_s = planner() if planner is not None else None
    cost = _cost(settings, m, booking, profile, remaining_term_h, step_time_s)
    _check_budget(m, cost)
    if cost.incremental_usd > m.budget.max_incremental_cost_usd:
        raise ItoError(
            ErrorCode.incremental_cost_exceeded,
            f"estimated ${cost.incremental_usd:,.2f} beyond the booking's remaining "
            f"term exceeds max_incremental_cost_usd "
            f"${m.budget.max_incremental_cost_usd:,.2f}",
        )
    # After the budget: an absurd training target is refused there first.
    curriculum = curriculum_report(curriculum_schedule(m))
    check_sync_pin(m, booking)
    report = {
        "model_preset": "ok",
        "gpu_sku": "ok",
        "fabric": "ok",
        "capacity": capacity,
        "data_policy": {"refs": n_refs, "schemes": list(settings.allowed_data_schemes)},
        "checkpoint_storage": {"path": storage, "inside_roots": True},
        "cost": cost.as_dict(),
        "curriculum": curriculum,
    }
    return report, cost
