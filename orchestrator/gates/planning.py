"""The parallelism plan of a manifest on a booking, from ``stages.parallelism``.

Advisory by default: ``POST /v1/plans`` shows the plan (or the planner's refusal)
and submit ignores it, because the run's own parallelism stage gates it later. With
``Settings.planner_gate`` the refusal is a server-side validation failure (its
``plan_*`` code, before any run exists), the planner's step time replaces the FLOP
bound of the cost estimate, and the plan is stored on the run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.db.store import Row, Store
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
    from stages.parallelism.hardware import resolve_gpu_sku
    from stages.parallelism.post_training import ObjectiveKind, check_objective_memory
    from stages.trainer.parallel.layout import ParallelLayout

    sku = resolve_gpu_sku(request.gpu_sku)
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


def sync_divides(m: Manifest) -> list[int]:
    """The steps a DiLoCo sync must fall on: the checkpoint interval and every phase's
    end (the training stage's ``TrainStageConfig._sync_fits`` checks the same)."""
    from orchestrator.gates.curriculum import curriculum_schedule

    interval = m.checkpoint.interval_steps
    ends = [p.end_step for p in curriculum_schedule(m).phases]
    return ([interval] if interval is not None else []) + ends


def rollout_gpus_per_node(m: Manifest, booking: dict[str, Any]) -> int:
    """GPUs on each of the booking's nodes that RLVR's rollout workers hold apart from
    the trainer's ranks, which the trainer is planned without.

    On a GPU booking each worker generates on a device of its own (the trainer's ranks
    hold one each, through every stage of the run), so the run keeps
    ``ceil(rollout_workers / node_count)`` GPUs on every node for them: the same on
    each node, so the trainer's topology stays uniform for the planner. None on the
    CPU testbed (its SKU's link is loopback), where a worker takes a CPU share beside
    the ranks; none without RLVR."""
    from stages.parallelism.hardware import resolve_gpu_sku

    rlvr = m.post_training.rlvr
    if rlvr is None or "gpu_sku" not in booking:
        return 0
    if resolve_gpu_sku(str(booking["gpu_sku"])).intra_node_link == "loopback":
        return 0
    nodes = int(booking.get("node_count") or 1)
    return -(-rlvr.rollout_workers // nodes)


def trainer_gpus(m: Manifest, booking: dict[str, Any]) -> int:
    """The booking's GPUs the trainer's ranks may hold (those the rollout workers do not)."""
    gpn = int(booking.get("gpus_per_node") or 1) - rollout_gpus_per_node(m, booking)
    return max(gpn, 0) * int(booking.get("node_count") or 1)


def check_sync_pin(m: Manifest, booking: dict[str, Any]) -> None:
    """A pinned sync the run could not keep is refused at submit (``plan_sync_invalid``),
    whether or not the planner gates: DiLoCo needs two replica groups (two GPUs) and
    an H that divides the checkpoint interval and the phases' ends."""
    from stages.parallelism.sync import check_pinned_sync

    if m.sync is None or m.sync.every_step:
        return
    if trainer_gpus(m, booking) < 2:
        raise ItoError(
            ErrorCode.plan_sync_invalid,
            "sync diloco syncs replica groups; the trainer's one GPU holds one group",
        )
    check_pinned_sync(m.sync, sync_divides(m))


def parallelism_config(manifest: Manifest, booking: dict[str, Any]) -> ParallelismConfig:
    """What the planner is asked, for ``ito plan`` and for the run alike.

    Live recovery needs a peer to heal from, so a booking of two or more GPUs is
    planned with at least two torchft replica groups. The manifest's sync pin, and the
    steps a DiLoCo sync must fall on, go with it. With RLVR on a GPU booking the
    trainer is planned on the GPUs its rollout workers leave (``rollout_gpus_per_node``)."""
    return ParallelismConfig(
        model=manifest.model.preset,
        global_batch_tokens=manifest.training.global_batch_tokens,
        seq_len=manifest.training.seq_len,
        min_replica_groups=2 if trainer_gpus(manifest, booking) >= 2 else 1,
        sync=manifest.sync,
        sync_divides=sync_divides(manifest),
        rollout_gpus_per_node=rollout_gpus_per_node(manifest, booking),
    )


def plan_manifest(
    m: Manifest, booking: dict[str, Any], time_budget_s: float | None = None
) -> PlanResult:
    """Plan ``m`` on the booking's topology within ``time_budget_s``; a refusal is
    returned, not raised."""
    try:
        config = parallelism_config(m, booking)
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


# The most replica groups a run may have (``TrainStageConfig.replica_groups``'s bound).
MAX_REPLICA_GROUPS = 64


@dataclass(frozen=True)
class GroupCount:
    """A run's replica-group count on its booking after a change, and why."""

    replica_groups: int
    ranks_per_group: int
    reason: str


def resize_groups(
    plan: dict[str, Any], booking: dict[str, Any], *, current_groups: int, grew: bool
) -> GroupCount:
    """The run's replica groups on ``booking`` as it is now, the layout inside each
    group as ``plan`` laid it out (tp x pp x cp x dp_shard ranks per group).

    As many whole groups as the booking's GPUs hold (at most ``MAX_REPLICA_GROUPS``),
    fewer where the run's fixed global batch would not split evenly over their
    data-parallel ranks and micro-batches (the trainer keeps the global batch and
    re-cuts every rank's share). No whole group: 0, the run pauses. A booking that
    ``grew`` but gives the run no group more is refused (``plan_resize_no_group``, or
    ``plan_resize_batch_not_divisible`` when the batch is what stands in the way); a
    shrink is never refused, since the nodes it lost are gone either way."""
    from stages.trainer.parallel.layout import layout_from_plan

    ranks = plan_ranks(plan)
    layout = layout_from_plan(plan).resolved(ranks)
    gpus = plan_gpus_per_node(plan, booking) * int(booking.get("node_count") or 0)
    sequences = int(plan["global_batch_tokens"]) // int(plan["seq_len"])
    whole = min(gpus // ranks, MAX_REPLICA_GROUPS)
    held = f"{gpus} GPUs hold {whole} whole group(s) of {ranks} ranks"
    if whole == 0:
        return GroupCount(0, ranks, f"{held}: the run pauses until capacity returns")

    def splits(groups: int) -> bool:
        dp = groups * layout.dp_shard
        if sequences % dp:
            return False
        per_rank = sequences // dp
        return per_rank % layout.grad_accum == 0 and (
            layout.pp == 1 or per_rank % layout.pp_microbatches == 0
        )

    groups = next((g for g in range(whole, 0, -1) if splits(g)), 0)
    batch = f"the global batch of {sequences} sequences"
    if grew and groups <= current_groups:
        if whole <= current_groups:
            raise ItoError(
                ErrorCode.plan_resize_no_group,
                f"{held}; the run has {current_groups} already",
            )
        raise ItoError(
            ErrorCode.plan_resize_batch_not_divisible,
            f"{held}, but {batch} splits evenly over no more than {current_groups} "
            f"group(s) x {layout.dp_shard} data-parallel ranks",
        )
    if groups == 0:  # the plan's own batch split no longer holds: nothing is safe
        raise ItoError(
            ErrorCode.plan_resize_batch_not_divisible,
            f"{held}, but {batch} splits evenly over none of them",
        )
    if groups < whole:
        return GroupCount(
            groups, ranks, f"{held}; {groups} split {batch} evenly over their data-parallel ranks"
        )
    return GroupCount(groups, ranks, held)


def run_plan(store: Store, run: Row) -> dict[str, Any] | None:
    """The plan the run trains with: its parallelism stage's, else the one stored at
    submit (``planner_gate``); None before it planned."""
    for gate in store.list_stage_gates(run["run_id"]):
        if gate["stage"] == "parallelism" and gate["status"] == "passed":
            plan = json.loads(gate["artifacts"]).get("plan")
            if isinstance(plan, dict):
                return plan
    return json.loads(run["plan"]) if run.get("plan") else None


def plan_gpus_per_node(plan: dict[str, Any], booking: dict[str, Any]) -> int:
    """The GPUs of each of the booking's nodes the trainer may hold under a stored
    ``plan``: the rest of them hold the run's rollout workers."""
    gpn = int(booking.get("gpus_per_node") or 0)
    return max(gpn - int(plan.get("rollout_gpus_per_node", 0)), 0)


def plan_ranks(plan: dict[str, Any]) -> int:
    """Ranks per replica group of a stored plan (tp x pp x cp x dp_shard)."""
    return int(plan["tp"]) * int(plan["pp"]) * int(plan["cp"]) * int(plan["dp_shard"])
