"""Decoder-only LMs from presets (random init) or a local HF checkpoint folder: the
repo's own Llama (``stages.model.llama``), with HF's names and numerics."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from stages.model.llama import Llama, LlamaArgs, RotaryEmbedding, load_hf_folder
from stages.presets import ModelPreset

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig


def build_model(
    preset: ModelPreset, *, seed: int = 0, checkpoint_path: str | Path | None = None
) -> Llama:
    """Random-init from the preset with a fixed seed, or load a local HF folder."""
    if checkpoint_path is not None:
        return load_hf_folder(checkpoint_path)
    torch.manual_seed(seed)
    return Llama(LlamaArgs.from_preset(preset))


def whole_rows(logits: torch.Tensor) -> torch.Tensor:
    """The logits with every vocabulary column: a model laid out with TP
    (``stages.trainer.parallel``) gives them sharded over the vocabulary, a DTensor,
    gathered here (differentiably); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def causal_lm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy; ``labels`` of -100 are ignored. A TP model's
    vocab-sharded logits are gathered (the trainer's own lm loss runs on the shards)."""
    logits = whole_rows(model(input_ids=input_ids).logits)
    target = input_ids if labels is None else labels
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(),
        target[:, 1:].reshape(-1),
        ignore_index=-100,
    )


def llama_config(preset: ModelPreset) -> LlamaConfig:
    """The transformers ``LlamaConfig`` of the preset (imports transformers)."""
    return hf_config(LlamaArgs.from_preset(preset))


def hf_config(args: LlamaArgs) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**args.hf_dict(), use_cache=False)


def set_config_rope_theta(config: PretrainedConfig, theta: float) -> None:
    """Set the RoPE base of a transformers config (the one an export is written with)."""
    params = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
    params["rope_theta"] = float(theta)
    config.rope_parameters = params


def model_config(
    preset: ModelPreset, *, checkpoint_path: str | Path | None = None
) -> PretrainedConfig:
    """The transformers config of what ``build_model`` builds, without building it."""
    if checkpoint_path is None:
        return llama_config(preset)
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.from_pretrained(
        str(checkpoint_path), local_files_only=True
    )
    return config


def set_rope_theta(model: torch.nn.Module, theta: float) -> None:
    """Set the RoPE base of a built model (its config and inverse frequencies), so a
    longer-context phase trains with a scaled base and its export keeps it."""
    config = getattr(model, "config", None)
    if isinstance(config, LlamaArgs):
        config.rope_theta = float(theta)
    for m in model.modules():  # a pipeline chunk holds the rotary module, not the config
        if isinstance(m, RotaryEmbedding):
            m.set_theta(theta)
