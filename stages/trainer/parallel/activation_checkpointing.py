"""Activation checkpointing of the repo's Llama: the one way recompute is turned on for
the model ``stages.model.lm.build_model`` returns (``ParallelModel`` applies it for
a layout's ``activation_checkpointing``)."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from stages.parallelism.spec import ActivationCheckpointing

# Ops whose outputs selective (op-level) checkpointing keeps, as torchtitan's
# op SAC does: the matmuls and attention; pointwise ops (norms, RoPE, SiLU, the
# gating product) are recomputed in the backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(
    _ctx: object, op: object, *_args: object, **_kwargs: object
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    # torch's helper is unannotated; its two contexts are what ``context_fn`` returns.
    contexts: tuple[AbstractContextManager[None], AbstractContextManager[None]] = (
        create_selective_checkpoint_contexts(_selective_policy)  # type: ignore[no-untyped-call]
    )
    return contexts


def apply_activation_checkpointing(model: Any, mode: ActivationCheckpointing) -> None:
    """Per decoder layer: ``full`` keeps only each layer's input and recomputes the
    layer in the backward; ``selective`` keeps matmul and attention outputs too."""
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    # ``built_layout`` reads the mode back from the partial: a context_fn is selective.
    recompute = (
        functools.partial(checkpoint, use_reentrant=False, context_fn=_selective_context)
        if mode == "selective"
        else functools.partial(checkpoint, use_reentrant=False)
    )
    for layer in model.model.layers:  # stages.model.llama.DecoderLayer's recompute hook
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = recompute
