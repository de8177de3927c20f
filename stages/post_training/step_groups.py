"""What the driver's rollout controller hands the learner's ranks for one RLVR step:
the step's rollout groups as they came from the fleet (``rollouts/step-<k>.json``,
written to a temp name and renamed, so a rank never reads half a file). The ranks
turn it into tensors themselves (``grpo_objective.assemble``): the driver builds no
tensor and never imports torch."""

from __future__ import annotations

from pathlib import Path

from stages.atomic_write import write_text
from stages.base import StrictModel
from stages.post_training.config import RLVRConfig
from stages.post_training.rollout import RolloutGroup


class StepGroups(StrictModel):
    """One step's global batch of groups; ``None``: a group refused as older than eta
    for this step (its rows are padding, never trained)."""

    step: int
    group_size: int
    pad_id: int
    scale_rewards: bool
    mask_truncated_completions: bool
    groups: list[RolloutGroup | None]

    def trained_tokens(self) -> int:
        """The completion tokens the step trains on (its loss's denominator)."""
        return sum(
            n
            for g in self.groups
            if g is not None
            for ids, cut in zip(g.completion_ids, g.truncated, strict=True)
            if not (self.mask_truncated_completions and cut)
            for n in [len(ids)]
        )


def step_groups(
    step: int, groups: list[RolloutGroup | None], cfg: RLVRConfig, pad_id: int
) -> StepGroups:
    """Step ``step``'s groups with the recipe's settings the ranks' tensors need."""
    return StepGroups(
        step=step,
        group_size=cfg.group_size,
        pad_id=pad_id,
        scale_rewards=cfg.scale_rewards,
        mask_truncated_completions=cfg.mask_truncated_completions,
        groups=groups,
    )


def step_groups_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}.json"


def write_step_groups(doc: StepGroups, folder: Path) -> Path:
    """Write ``doc`` for its step: the whole file appears at once or not at all."""
    path = step_groups_path(folder, doc.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not durable: a driver relaunched after a crash drops every batch from the newest
    # checkpoint on and regenerates them (``discard_after_checkpoint``).
    write_text(path, doc.model_dump_json(), durable=False)
    return path
