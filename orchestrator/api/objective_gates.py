"""Each post-training objective's gate in a run's view (``post_training_gates``): the
objectives the run's manifest names, each with its gate metric, bound and battery, and
the verdict once the stage has reported it (the objective's ``eval_gates`` entry, phase
``post_training.<objective>``); before that it is pending, and an objective the run
ended without deciding (an earlier gate failed, a cancel) is ``not_run``."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.db.engines import Row
from orchestrator.runs import ACTIVE
from stages.post_training.config import PostTrainingConfig
from stages.post_training.gate_events import gate_phase


class ObjectiveGateStatus(StrEnum):
    passed = "passed"
    failed = "failed"
    pending = "pending"  # the run is still active and has not decided it yet
    not_run = "not_run"  # the run ended without deciding it


class ObjectiveGateView(BaseModel):
    """One objective's gate, as ``GET /v1/runs/{id}`` sends it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: str
    # The ``eval_gates`` entry holding its checks (gate metric, the scores it comes
    # from, the named battery's checks), once decided.
    phase: str
    status: ObjectiveGateStatus
    # The gate: ``metric >= min``; both None where the objective has no gate metric.
    metric: str | None
    min: float | None
    # The gate metric as measured; None until decided (or without a gate metric).
    value: float | None
    # The curriculum eval battery the objective also runs and gates on, if it names one.
    battery: str | None
    # The objective's steps: as trained once decided, as configured before.
    steps: int | None
    # Why it failed: the first failed check and its reason.
    reason: str = ""


# Runs whose recipes are kept parsed (by manifest text): a status poll re-reads its
# run's manifest, and validating a recipe costs far more than the rest of the view.
# At most this many manifests are held (each under Settings.max_manifest_bytes).
RECIPE_CACHE_SIZE = 64


@dataclass(frozen=True)
class _Configured:
    """An objective's gate as the manifest sets it."""

    objective: str
    metric: str | None
    min: float | None
    battery: str | None
    steps: int


@functools.lru_cache(maxsize=RECIPE_CACHE_SIZE)
def _configured(manifest_json: str) -> tuple[_Configured, ...]:
    """Each objective the manifest's post-training recipe names, in the chain's order;
    none where it has no recipe, or where a run stored by an older server no longer
    parses (its view then shows the decided gates only in ``eval_gates``)."""
    try:
        section = json.loads(manifest_json).get("post_training")
        recipe = PostTrainingConfig.model_validate(section) if section else None
    except (ValueError, ValidationError, AttributeError):
        return ()
    if recipe is None:
        return ()
    configured = []
    for objective in recipe.objectives():
        cfg = getattr(recipe, objective)
        gate = cfg.gate
        configured.append(
            _Configured(
                objective=objective,
                metric=gate.metric if gate is not None else None,
                min=gate.min if gate is not None else None,
                battery=cfg.eval.battery,
                steps=cfg.steps,
            )
        )
    return tuple(configured)


def _failed(check: dict[str, Any]) -> str:
    """A failed check's reason, naming the check (a battery's reasons do not)."""
    reason = str(check.get("reason") or "failed")
    return reason if check["check"] in reason else f"{check['check']}: {reason}"


def objective_gates(run: Row, eval_gates: list[dict[str, Any]]) -> list[ObjectiveGateView]:
    """Every objective the run's manifest names, in the chain's order, with its gate as
    configured and, from ``eval_gates`` (the view's), its verdict."""
    decided = {g["phase"]: g for g in eval_gates}
    ended = run["state"] not in ACTIVE
    views = []
    for cfg in _configured(run["manifest_json"]):
        phase = gate_phase(cfg.objective)
        gate = decided.get(phase)
        if gate is None:
            status = ObjectiveGateStatus.not_run if ended else ObjectiveGateStatus.pending
            value, steps, reason = None, cfg.steps, ""
        else:
            checks = gate["checks"]
            measured = next((c for c in checks if c["check"] == cfg.metric), None)
            status = ObjectiveGateStatus.passed if gate["passed"] else ObjectiveGateStatus.failed
            value = measured["score"] if measured else None
            steps = gate["step"]
            reason = next((_failed(c) for c in checks if not c["passed"]), "")
        views.append(
            ObjectiveGateView(
                objective=cfg.objective,
                phase=phase,
                status=status,
                metric=cfg.metric,
                min=cfg.min,
                value=value,
                battery=cfg.battery,
                steps=steps,
                reason=reason,
            )
        )
    return views
