"""Why a resize request cannot be applied to a running run ("" when it can): what the
run's config rules out (its objective, DiLoCo, a batch that does not split over the new
groups, a pipeline's fixed micro-batches) and what its state does (already paused, a
group lost). ``GroupResizer`` refuses such a request with this reason before any rank
moves."""

from __future__ import annotations

from stages.resize import ResizeRequest
from stages.trainer.config import TrainStageConfig


def resize_refusal(
    cfg: TrainStageConfig, request: ResizeRequest, *, paused: bool, group_lost: bool
) -> str:
    """Why ``request`` cannot be applied to a run of ``cfg`` now ("" if it can);
    ``paused``: the run is paused for capacity; ``group_lost``: a replica group is lost
    and not yet healed."""
    if cfg.objective.kind != "lm":
        return f"the {cfg.objective.kind} objective keeps its replica groups"
    if not cfg.sync.every_step:
        # A resize holds every group after one agreed step: DiLoCo agrees at syncs only.
        return "a DiLoCo run keeps its replica groups"
    width = request.replica_groups * cfg.layout.dp_shard
    for phase in cfg.schedule.phases:  # each phase's batch, at its sequence length
        batch = cfg.micro_batch_at(phase.seq_len) * cfg.dp_world
        layout = cfg.layout
        if width and (
            batch % width or (layout.pp > 1 and (batch // width) % layout.pp_microbatches)
        ):
            return (
                f"phase {phase.name}'s global batch of {batch} sequences does not "
                f"split over {width} data-parallel ranks"
                + (f" in {layout.pp_microbatches} micro-batches" if layout.pp > 1 else "")
            )
    if cfg.layout.pp > 1 and 0 < request.replica_groups < cfg.replica_groups:
        # Fewer groups grow each rank's share; without a pipeline a rank takes more
        # passes of the plan's size (``ParallelModel.passes``), but a pipeline's
        # micro-batch count is fixed with its schedule: each would outgrow the
        # memory the plan checked.
        return (
            f"a pipelined run keeps its planned {cfg.replica_groups} replica groups: "
            f"on {request.replica_groups} each pipeline micro-batch would outgrow "
            "the plan's memory"
        )
    if request.replica_groups == 0 and paused:
        return "the run is already paused for capacity"
    if group_lost:
        return "a replica group is lost; resize once it healed"
    return ""
