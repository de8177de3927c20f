"""Checkpoint policy of a run (the manifest embeds it)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from stages.base import StrictModel
from stages.errors import ErrorCode
from stages.pathfields import PathField

# What ``ito manifest init`` writes and what the checkpoint-restart baseline of
# benchmarks/fault_tolerance.py uses: the production default interval.
DEFAULT_INTERVAL_STEPS = 100
DEFAULT_KEEP = 3


class CheckpointPolicy(StrictModel):
    interval_steps: int | None = Field(default=None, gt=0, le=100_000_000)
    interval_minutes: float | None = Field(default=None, gt=0, le=7 * 24 * 60, allow_inf_nan=False)
    keep: int = Field(default=DEFAULT_KEEP, ge=1, le=100)
    # file:///absolute/dir is the only storage this build writes to.
    storage_uri: Annotated[
        str,
        PathField(
            "checkpoint",
            "dir",
            form="file_uri",
            not_local=ErrorCode.checkpoint_storage_invalid,
            not_canonical=ErrorCode.checkpoint_storage_invalid,
        ),
    ]

    @field_validator("storage_uri")
    @classmethod
    def _file_uri(cls, v: str) -> str:
        if not v.startswith("file:///"):
            raise ValueError("storage_uri must be a file:///absolute/path URI")
        return v

    @model_validator(mode="after")
    def _some_interval(self) -> CheckpointPolicy:
        if self.interval_steps is None and self.interval_minutes is None:
            raise ValueError("set interval_steps and/or interval_minutes")
        return self

    @property
    def storage_path(self) -> str:
        return self.storage_uri.removeprefix("file://")
