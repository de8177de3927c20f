"""The parallelism plan of a manifest on a booking, from ``stages.parallelism``.

Advisory by default: ``POST /v1/plans`` shows the plan (or the planner's refusal)
and submit ignores it, because the run's own parallelism stage gates it later. With
``Settings.planner_gate`` the refusal is a server-side validation failure (its
``plan_*`` code, before any run exists), the planner's step time replaces the FLOP
bound of the cost estimate, and the plan is stored on the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.gates.manifest import Manifest
from stages.errors import ErrorCode, ItoError
from stages.parallelism import ParallelismConfig, plan, request_from
from stages.parallelism.spec import Plan, PlanRequest

log = logging.getLogger("ito.api")


@dataclass(frozen=True)
class PlanResult:
    plan: dict[str, Any] | None
    refusal: dict[str, Any] | None
    step_time_s: float | None

    def raise_refusal(self) -> None:
        if self.refusal is not None:
            raise ItoError(ErrorCode(self.refusal["code"]), self.refusal["message"])


def check_post_training_objectives(m: Manifest, request: PlanRequest, chosen: Plan) -> None:
    """Each SFT, DPO and RLVR objective fits the booking's devices on the ``chosen``
    plan's replica groups and their ranks (``ParallelLayout.for_post_training``,
    ``stages.parallelism.post_training``; the model is the manifest's preset)."""
    from stages.parallelism.hardware import load_gpu_sku
    from stages.parallelism.post_training import ObjectiveKind, check_objective_memory
    from stages.trainer.parallel.layout import ParallelLayout

    sku = load_gpu_sku(request.gpu_sku)
    layout = ParallelLayout(
        tp=chosen.tp, pp=chosen.pp, cp=chosen.cp, dp_shard=chosen.dp_shard
    ).for_post_training()
    p = m.post_training
    objectives: list[tuple[ObjectiveKind, int, int, bool]] = []
    if p.sft is not None:
        objectives.append(("sft", p.sft.batch_size, p.sft.max_length, False))
    if p.dpo is not None:
        objectives.append(("dpo", p.dpo.batch_size, p.dpo.max_length, False))
    if p.rlvr is not None:
        r = p.rlvr
        length = r.max_prompt_tokens + r.max_completion_tokens
        objectives.append(("rlvr", r.groups_per_step * r.group_size, length, r.beta > 0))
    for kind, batch, length, reference in objectives:
        check_objective_memory(
            request.preset(),
            objective=kind,
            batch_size=batch,
            max_length=length,
            replica_groups=chosen.dp_replicate,
            tp=layout.tp,
            fsdp=layout.dp_shard,
            device_memory_gib=sku.memory_gib,
            memory_utilization=request.memory_utilization,
            foreach_optimizer=sku.intra_node_link != "loopback",
            resident_reference=reference,
        )


def parallelism_config(manifest: Manifest, booking: dict[str, Any]) -> ParallelismConfig:
    """What the planner is asked, for ``ito plan`` and for the run alike.

    Live recovery needs a peer to heal from, so a booking of two or more GPUs is
    planned with at least two torchft replica groups."""
    gpus = int(booking.get("gpus_per_node") or 1) * int(booking.get("node_count") or 1)
    return ParallelismConfig(
        model=manifest.model.preset,
        global_batch_tokens=manifest.training.global_batch_tokens,
        seq_len=manifest.training.seq_len,
        min_replica_groups=2 if gpus >= 2 else 1,
    )


def plan_manifest(
    m: Manifest, booking: dict[str, Any], time_budget_s: float | None = None
) -> PlanResult:
    """Plan ``m`` on the booking's topology within ``time_budget_s``; a refusal is
    returned, not raised."""
    config = parallelism_config(m, booking)
    try:
        request = request_from(config, booking)
        chosen = plan(request, time_budget_s)
        check_post_training_objectives(m, request, chosen)
    except ItoError as e:
        return PlanResult(None, {"code": str(e.code), "message": e.message}, None)
    except ValidationError as e:
        message = "; ".join(str(x["msg"]) for x in e.errors(include_input=False)[:3])
        return PlanResult(
            None,
            {"code": str(ErrorCode.plan_no_feasible), "message": f"cannot plan: {message}"},
            None,
        )
    except Exception:  # a planner bug must not take the advisory plan call down
        log.exception("planner crashed")
        return PlanResult(
            None,
            {
                "code": str(ErrorCode.internal_error),
                "message": "the planner failed; see the server log",
            },
            None,
        )
    dumped = chosen.model_dump(mode="json")
    try:  # a plan the trainer could not apply on this device is refused here too
        from stages.trainer.parallel.layout import check_runnable_on_sku, layout_from_plan

        check_runnable_on_sku(layout_from_plan(dumped), str(booking.get("gpu_sku", "")))
    except ItoError as e:
        return PlanResult(None, {"code": str(e.code), "message": e.message}, None)
    return PlanResult(dumped, None, chosen.step_time_s)
