"""``ParallelismStage``: plans the booking's layout, or fails its gate with the refusal."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ValidationError

from stages.base import GateOutcome, StageContext
from stages.errors import ErrorCode, ItoError
from stages.parallelism.config import ParallelismConfig
from stages.parallelism.search import plan
from stages.parallelism.spec import PlanRequest

BOOKING_FIELDS = ("gpu_sku", "gpus_per_node", "node_count", "fabric")


def request_from(config: ParallelismConfig, booking: dict[str, Any]) -> PlanRequest:
    """The plan request for ``config`` on a booking's topology (its facts dict)."""
    missing = [k for k in BOOKING_FIELDS if k not in booking]
    if missing:
        raise ItoError(ErrorCode.booking_incomplete, f"booking topology lacks {', '.join(missing)}")
    gpus, held = int(booking["gpus_per_node"]), config.rollout_gpus_per_node
    trainer_gpus = gpus - held
    if trainer_gpus < 1:
        raise ItoError(
            ErrorCode.rollout_gpus_insufficient,
            f"the rollout workers hold {held} of each node's {gpus} GPUs: none is left to train on",
        )
    return PlanRequest(
        model=config.model,
        gpu_sku=str(booking["gpu_sku"]),
        gpus_per_node=trainer_gpus,
        rollout_gpus_per_node=config.rollout_gpus_per_node,
        node_count=int(booking["node_count"]),
        fabric=str(booking["fabric"]),
        global_batch_tokens=config.global_batch_tokens,
        seq_len=config.seq_len,
        precision=config.precision,
        activation_checkpointing=config.activation_checkpointing,
        mfu_floor=config.mfu_floor,
        max_pp_bubble=config.max_pp_bubble,
        min_replica_groups=config.min_replica_groups,
        sync=config.sync,
        sync_divides=config.sync_divides,
    )


class ParallelismStage:
    name: ClassVar[str] = "parallelism"
    config_model: ClassVar[type[ParallelismConfig]] = ParallelismConfig

    def __init__(self, config: ParallelismConfig):
        self.config = config

    def run(self, ctx: StageContext) -> GateOutcome:
        try:
            request = request_from(self.config, ctx.facts.booking.as_dict())
            chosen = plan(request)
        except ItoError as err:
            ctx.log(f"planner refused: {err.code}: {err.message}", level="error", stage=self.name)
            return GateOutcome(
                stage=self.name,
                status="failed",
                reason=err.message,
                error_code=str(err.code),
                artifacts={
                    "refusal": {"code": str(err.code), "message": err.message, **err.details}
                },
            )
        except ValidationError as err:
            return GateOutcome(
                stage=self.name,
                status="failed",
                reason=f"invalid plan request: {err.errors()[0]['msg']}",
                error_code=str(ErrorCode.validation_error),
            )
        ctx.log(
            f"plan: tp {chosen.tp} pp {chosen.pp} cp {chosen.cp} dp_shard "
            f"{chosen.dp_shard} dp_replicate {chosen.dp_replicate} micro-batch "
            f"{chosen.micro_batch} ac {chosen.activation_checkpointing} "
            f"{chosen.precision}, {chosen.peak_memory_gib:.1f} GiB, MFU {chosen.mfu:.0%}",
            stage=self.name,
        )
        return GateOutcome(
            stage=self.name,
            status="passed",
            reason=f"{chosen.world_size} GPUs as tp {chosen.tp} x pp {chosen.pp} x cp "
            f"{chosen.cp} x dp_shard {chosen.dp_shard} x dp_replicate "
            f"{chosen.dp_replicate}; predicted MFU {chosen.mfu:.0%}",
            metrics={
                "peak_memory_gib": chosen.peak_memory_gib,
                "mfu": chosen.mfu,
                "tokens_per_s": chosen.tokens_per_s,
                "step_time_s": chosen.step_time_s,
            },
            artifacts={"plan": chosen.model_dump()},
        )
