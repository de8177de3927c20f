"""Post-training recipe: SFT -> DPO -> RLVR (GRPO with the DAPO fixes)."""

from __future__ import annotations

from pydantic import Field

from stages.base import StrictModel
from stages.data_prep.config import DataRef

MAX_STEPS = 100_000_000


class SFTConfig(StrictModel):
    data: DataRef
    steps: int = Field(gt=0, le=MAX_STEPS)
    learning_rate: float = Field(default=2e-5, gt=0, le=10, allow_inf_nan=False)


class DPOConfig(StrictModel):
    data: DataRef
    steps: int = Field(gt=0, le=MAX_STEPS)
    beta: float = Field(default=0.1, gt=0, le=1e3, allow_inf_nan=False)
    learning_rate: float = Field(default=5e-7, gt=0, le=10, allow_inf_nan=False)


class RLVRConfig(StrictModel):
    """GRPO with DAPO: clip-higher, dynamic sampling, token-level loss, overlong shaping."""

    data: DataRef
    steps: int = Field(gt=0, le=MAX_STEPS)
    reward: str = Field(default="gsm8k_exact_match", max_length=64)
    group_size: int = Field(default=8, ge=2, le=1024)
    epsilon: float = Field(default=0.2, gt=0)
    epsilon_high: float = Field(default=0.28, gt=0)
    beta: float = Field(default=0.0, ge=0)
    dynamic_sampling: bool = True
    overlong_buffer_tokens: int = Field(default=64, ge=0)
    max_completion_tokens: int = Field(default=256, gt=0)
    rollout_workers: int = Field(default=1, ge=1)
    max_staleness: int = Field(default=1, ge=0, description="policy versions a rollout may lag")


class PostTrainingConfig(StrictModel):
    sft: SFTConfig | None = None
    dpo: DPOConfig | None = None
    rlvr: RLVRConfig | None = None
