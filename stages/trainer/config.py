"""Typed configs of the training engine (the manifest embeds them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.base import StrictModel


class ModelSpec(StrictModel):
    preset: str = Field(description="Name of a configs/models preset, e.g. llama-tiny")
    architecture: Literal["llama"] = "llama"
    size: str = Field(description="Human label of the size, e.g. '124K' or '8B'")
    revision: str = Field(default="random-init", max_length=128)
    # A local Hugging Face checkpoint folder; None builds from the preset, random init.
    checkpoint_path: str | None = None


class TrainingTarget(StrictModel):
    max_steps: int | None = Field(default=None, gt=0)
    target_tokens: int | None = Field(default=None, gt=0)
    seq_len: int = Field(default=128, gt=1)
    global_batch_tokens: int = Field(gt=0)
    learning_rate: float = Field(default=3e-4, gt=0)
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    seed: int = 0
    deterministic: bool = True

    @model_validator(mode="after")
    def _one_target(self) -> TrainingTarget:
        if (self.max_steps is None) == (self.target_tokens is None):
            raise ValueError("set exactly one of max_steps and target_tokens")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError("global_batch_tokens must be a multiple of seq_len")
        return self

    @property
    def steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        assert self.target_tokens is not None
        return -(-self.target_tokens // self.global_batch_tokens)


class LossSpikeConfig(StrictModel):
    """Rolling robust z-score (median / MAD) on the loss."""

    enabled: bool = True
    window: int = Field(default=50, ge=5)
    z_threshold: float = Field(default=6.0, gt=0)
    min_steps: int = Field(default=20, ge=1, description="steps before detection starts")
    skip_window_steps: int = Field(default=10, ge=1, description="data window to skip on restart")
