"""Eval batteries: ``configs/evals/<battery>.json``, a fixed list of checks.

A battery is an eval suite (``stages.data_prep.evals``: its item files are what
decontamination matches against) plus ``checks``. Each check yields one number:

- ``heldout``: ``loss`` (mean next-token nats) or ``bits_per_byte`` on the run's
  held-out split;
- ``lm_eval``: one metric of an lm-evaluation-harness task, a YAML file beside the
  battery over vendored local files (``generate_until`` exact match,
  ``multiple_choice`` acc, ...).

Gate thresholds name checks. ``higher_is_better`` orients regression bounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.base import StrictModel
from stages.errors import ErrorCode, ItoError
from stages.presets import configs_dir, list_configs

# Scores and losses are small numbers; a bound keeps a gate finite and comparable.
THRESHOLD_BOUND = 1e12


class BatteryCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")
    kind: Literal["heldout", "lm_eval"]
    metric: str = Field(min_length=1, max_length=64)
    higher_is_better: bool
    # lm_eval: the task YAML, relative to configs/evals/.
    task: str | None = None
    filter: str = "none"

    @model_validator(mode="after")
    def _kind(self) -> BatteryCheck:
        if self.kind == "lm_eval" and not self.task:
            raise ValueError(f"check {self.name}: an lm_eval check needs a task")
        if self.kind == "heldout" and self.metric not in ("loss", "bits_per_byte"):
            raise ValueError(f"check {self.name}: heldout metrics are loss, bits_per_byte")
        return self


class Battery(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # suite fields are data prep's
    name: str
    description: str = ""
    checks: list[BatteryCheck] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Battery:
        if len({c.name for c in self.checks}) != len(self.checks):
            raise ValueError("check names must be unique")
        return self

    @property
    def check_names(self) -> list[str]:
        return [c.name for c in self.checks]

    def task_paths(self) -> list[Path]:
        return sorted({evals_dir() / c.task for c in self.checks if c.task})


def evals_dir() -> Path:
    return configs_dir() / "evals"


def list_batteries() -> list[str]:
    """Suites that have checks."""
    return list_configs("evals", Battery)


def load_battery(name: str) -> Battery:
    path = evals_dir() / f"{name}.json"
    if "/" in name or name.startswith(".") or not path.is_file():
        raise ItoError(
            ErrorCode.eval_battery_unknown,
            f"unknown eval battery {name!r}; known: {', '.join(list_batteries())}",
        )
    try:
        battery = Battery.model_validate_json(path.read_bytes())
    except ValueError as e:
        raise ItoError(
            ErrorCode.eval_battery_unknown, f"{name!r} is not an eval battery (no valid checks)"
        ) from e
    for task in battery.task_paths():
        if not task.is_file():
            raise ItoError(
                ErrorCode.eval_battery_unknown, f"battery {name!r}: task file {task.name} missing"
            )
    return battery


class GateThreshold(StrictModel):
    """A bound on one check of the phase's battery (``metric`` names the check)."""

    metric: str = Field(min_length=1, max_length=64)
    max: float | None = Field(default=None, ge=-THRESHOLD_BOUND, le=THRESHOLD_BOUND)
    min: float | None = Field(default=None, ge=-THRESHOLD_BOUND, le=THRESHOLD_BOUND)
    max_regression: float | None = Field(
        default=None,
        ge=0,
        le=THRESHOLD_BOUND,
        description="allowed worsening vs the previous phase's result of this check",
    )

    @model_validator(mode="after")
    def _bound(self) -> GateThreshold:
        if self.max is None and self.min is None and self.max_regression is None:
            raise ValueError("a gate needs max, min and/or max_regression")
        return self


class EvalRunSettings(BaseModel):
    """How a battery runs (not what it checks: that is the battery's, fixed)."""

    model_config = ConfigDict(extra="forbid")
    check_timeout_s: float = Field(
        default=600.0, gt=0, description="wall-clock bound of one check group"
    )
    heldout_max_tokens: int = Field(default=16384, gt=0)
    heldout_seq_len: int | None = Field(
        default=None, gt=1, description="default: the phase's seq_len"
    )
    batch_size: int = Field(default=8, gt=0)
    max_length: int | None = Field(
        default=None, gt=0, description="lm-eval context; default: the model's"
    )
    limit: int | None = Field(default=None, gt=0, description="items per task (tests)")
    seed: int = 0
    # The driver's wait for the evaluating rank: every check group plus the export.
    rank_eval_timeout_s: float = Field(default=3600.0, gt=0)
    # The most bytes of weights in one safetensors file of a phase's HF export (and so
    # in one writing rank at a time; the live ranks write the files between them).
    export_shard_bytes: int = Field(default=2 << 30, gt=0)
