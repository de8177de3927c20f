"""Model presets from ``configs/models/*.json``: shapes only, no torch.

The planner reads shapes to size memory and FLOPs; the trainer builds a model from
the same preset. Presets are plain JSON so a tenant's manifest can name one.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.errors import ErrorCode, ItoError

M = TypeVar("M", bound=BaseModel)


def configs_dir() -> Path:
    """The repo's ``configs/`` folder (``ITO_CONFIGS_DIR`` overrides)."""
    env = os.environ.get("ITO_CONFIGS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "configs"


class ModelPreset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    architecture: Literal["llama"] = "llama"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # Mixture of experts: 0 experts means dense.
    num_experts: int = Field(default=0, ge=0)
    experts_per_token: int = Field(default=0, ge=0)
    description: str = ""

    @model_validator(mode="after")
    def _check_shape(self) -> ModelPreset:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError("experts_per_token must be in 1..num_experts for MoE")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_params(self) -> tuple[int, int]:
        """(attention + norms, MLP) parameters of one decoder layer (all experts)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv + 2 * h  # q, o, k, v projections + 2 RMSNorms
        experts = max(self.num_experts, 1)
        mlp = experts * 3 * h * self.intermediate_size
        if self.num_experts:
            mlp += h * self.num_experts  # router
        return attn, mlp

    @property
    def num_params(self) -> int:
        attn, mlp = self.layer_params()
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_hidden_layers * (attn + mlp) + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters touched per token (MoE counts only the routed experts)."""
        if not self.num_experts:
            return self.num_params
        attn, _ = self.layer_params()
        h = self.hidden_size
        mlp = self.experts_per_token * 3 * h * self.intermediate_size + h * self.num_experts
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_hidden_layers * (attn + mlp) + h


def list_configs(kind: str, model: type[BaseModel] | None = None) -> list[str]:
    """Names of the JSON configs in ``configs/<kind>/``; with ``model``, only those that
    validate as one (``configs/evals/`` holds batteries and eval suites side by side)."""
    names = []
    for p in sorted((configs_dir() / kind).glob("*.json")):
        if model is not None:
            try:
                model.model_validate_json(p.read_bytes())
            except ValueError:
                continue
        names.append(p.stem)
    return names


def load_config(kind: str, name: str, model: type[M], unknown: ErrorCode) -> M:
    """``configs/<kind>/<name>.json`` as ``model``; an unknown name is ``unknown``."""
    path = configs_dir() / kind / f"{name}.json"
    if "/" in name or not path.is_file():
        raise ItoError(
            unknown,
            f"unknown {kind[:-1].replace('_', ' ')} {name!r}; "
            f"known: {', '.join(list_configs(kind))}",
        )
    return model.model_validate_json(path.read_bytes())


def list_model_presets() -> list[str]:
    return list_configs("models")


@cache
def load_model_preset(name: str) -> ModelPreset:
    return load_config("models", name, ModelPreset, ErrorCode.model_preset_unknown)
