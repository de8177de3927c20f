"""The repo's Llama (``stages.model.llama``) seen as a ``transformers`` model over
the same tensors, for what needs HF's class: lm-eval's ``HFLM`` (its generate) and
``save_pretrained``. No weight is copied: the view's parameters are the model's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def as_hf(model: torch.nn.Module) -> PreTrainedModel:
    """``model`` itself if it is a transformers model, else its HF view."""
    from transformers import LlamaForCausalLM, PreTrainedModel

    from stages.model.llama import Llama
    from stages.model.lm import hf_config

    if isinstance(model, PreTrainedModel):
        return model
    if not isinstance(model, Llama):
        raise TypeError(f"no Hugging Face view of a {type(model).__name__}")
    config = hf_config(model.config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        view = LlamaForCausalLM(config)
    # assign: the view's parameters become the model's tensors (tied ones stay tied)
    view.load_state_dict(model.state_dict(keep_vars=True), strict=True, assign=True)
    device = next(model.parameters()).device
    view.model.rotary_emb = type(view.model.rotary_emb)(config=config).to(device)
    view.train(model.training)
    return view
