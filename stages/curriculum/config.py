"""Curriculum phases and their eval gates (the manifest's ``curriculum`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.base import StrictModel
from stages.evals.config import GateThreshold

DataRole = Literal["baseline", "custom"]

__all__ = ["CurriculumConfig", "CurriculumPhase", "DataRole", "GateThreshold"]


def _all_roles() -> list[DataRole]:
    return ["baseline", "custom"]


class CurriculumPhase(StrictModel):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    kind: Literal["pretrain", "mid_train", "long_context", "post_training"]
    token_fraction: float = Field(gt=0, le=1, description="share of the training target")
    seq_len: int | None = Field(default=None, gt=1)
    data_roles: list[DataRole] = Field(default_factory=_all_roles)
    eval_battery: str = Field(default="smoke", description="configs/evals battery name")
    gates: list[GateThreshold] = Field(default_factory=list)


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
