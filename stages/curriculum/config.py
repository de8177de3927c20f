"""Curriculum phases and their eval gates (the manifest's ``curriculum`` section)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from stages.base import StrictModel
from stages.evals.config import GateThreshold

DataRole = Literal["baseline", "custom"]
PhaseKind = Literal["pretrain", "mid_train", "long_context", "post_training"]
TRAINER_KINDS: tuple[PhaseKind, ...] = ("pretrain", "mid_train", "long_context")

__all__ = [
    "TRAINER_KINDS",
    "CurriculumConfig",
    "CurriculumPhase",
    "DataRole",
    "GateThreshold",
    "PhaseKind",
]


def _all_roles() -> list[DataRole]:
    return ["baseline", "custom"]


class CurriculumPhase(StrictModel):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    kind: PhaseKind
    token_fraction: float = Field(gt=0, le=1, description="share of the training target")
    seq_len: int | None = Field(
        default=None, gt=1, le=1 << 20, description="default: training.seq_len"
    )
    data_roles: list[DataRole] = Field(default_factory=_all_roles, max_length=16)
    # Sampling weight of each role's sequences; roles not named weigh 1.
    data_weights: dict[DataRole, Annotated[float, Field(le=1e6)]] = Field(default_factory=dict)
    eval_battery: str = Field(default="smoke", description="configs/evals battery name")
    gates: list[GateThreshold] = Field(default_factory=list, max_length=64)
    # Warmup-stable-decay per phase: the decay at the end of the phase is the anneal.
    lr_schedule: Literal["wsd", "cosine", "constant"] = "wsd"
    lr_scale: float = Field(default=1.0, gt=0, le=10, description="peak LR = this * training LR")
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        le=100_000_000,
        description="default: training.warmup_steps in the first phase, 0 after",
    )
    decay_fraction: float = Field(default=0.2, ge=0, le=1)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    # RoPE base; None: the preset's, NTK-scaled by seq_len / the first phase's seq_len.
    rope_theta: float | None = Field(default=None, gt=0, le=1e12)

    @model_validator(mode="after")
    def _weights(self) -> CurriculumPhase:
        unknown = set(self.data_weights) - set(self.data_roles)
        if unknown:
            raise ValueError(f"data_weights for roles not in data_roles: {sorted(unknown)}")
        if any(w <= 0 for w in self.data_weights.values()):
            raise ValueError("data_weights must be positive")
        if len(set(self.data_roles)) != len(self.data_roles) or not self.data_roles:
            raise ValueError("data_roles must be non-empty and unique")
        return self


class CurriculumConfig(StrictModel):
    phases: list[CurriculumPhase] = Field(min_length=1, max_length=16)

    @model_validator(mode="after")
    def _fractions(self) -> CurriculumConfig:
        total = sum(p.token_fraction for p in self.phases)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"phase token_fraction must sum to 1 (got {total:.4f})")
        if len({p.name for p in self.phases}) != len(self.phases):
            raise ValueError("phase names must be unique")
        return self
