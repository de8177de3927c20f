"""Decoder-only LMs from presets (random init) or a local HF checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from stages.presets import ModelPreset


def llama_config(preset: ModelPreset) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        tie_word_embeddings=preset.tie_word_embeddings,
        use_cache=False,
    )


def build_model(
    preset: ModelPreset, *, seed: int = 0, checkpoint_path: str | Path | None = None
) -> LlamaForCausalLM:
    """Random-init from the preset with a fixed seed, or load a local HF folder."""
    if checkpoint_path is not None:
        # fp32 master weights whatever dtype the folder was saved in (the layout's
        # precision decides what the compute runs in).
        return LlamaForCausalLM.from_pretrained(
            str(checkpoint_path), local_files_only=True, dtype=torch.float32
        )
    if preset.num_experts:
        raise ValueError(f"preset {preset.name} is MoE; only dense Llama is buildable here")
    torch.manual_seed(seed)
    config = llama_config(preset)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def causal_lm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy; ``labels`` of -100 are ignored."""
    logits = model(input_ids=input_ids).logits
    target = input_ids if labels is None else labels
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(),
        target[:, 1:].reshape(-1),
        ignore_index=-100,
    )


def set_config_rope_theta(config: Any, theta: float) -> None:
    """Set the RoPE base a model of ``config`` is built with (and exported with)."""
    params = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
    params["rope_theta"] = float(theta)
    config.rope_parameters = params


def model_config(preset: ModelPreset, *, checkpoint_path: str | Path | None = None) -> Any:
    """The config ``build_model`` builds from, without building anything."""
    if checkpoint_path is None:
        return llama_config(preset)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(checkpoint_path), local_files_only=True)


def set_rope_theta(model: torch.nn.Module, theta: float) -> None:
    """Set the RoPE base of a built Llama (config and the cached inverse frequencies),
    so a longer-context phase trains with a scaled base and an HF export keeps it."""
    config: Any = model.config
    set_config_rope_theta(config, theta)
    inner: Any = getattr(model, "model", model)
    rotary = inner.rotary_emb
    inner.rotary_emb = type(rotary)(config=config).to(next(model.parameters()).device)
