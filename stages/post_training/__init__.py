"""post_training stage: SFT -> DPO -> RLVR (GRPO with the DAPO fixes) on a rollout fleet."""

from stages.post_training.config import PostTrainingConfig
from stages.post_training.stage import PostTrainingStage, PostTrainingStageConfig

__all__ = ["PostTrainingConfig", "PostTrainingStage", "PostTrainingStageConfig"]
