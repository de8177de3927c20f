"""Hugging Face formats: the run's tokenizer and model exports that lm-eval, trl and
users load with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(dir)``.

Light on purpose: importing ``stages.hf`` (or its ``bpe`` module, which the driver
uses) pulls in neither transformers nor torch; each name below is imported on first
use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.hf.bpe import CHAT_TEMPLATE, SPECIAL_TOKENS
    from stages.hf.export import export_hf, load_hf, load_model
    from stages.hf.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

_HOME = {
    "CHAT_TEMPLATE": "stages.hf.bpe",
    "SPECIAL_TOKENS": "stages.hf.bpe",
    "export_hf": "stages.hf.export",
    "load_hf": "stages.hf.export",
    "load_model": "stages.hf.export",
    "load_tokenizer": "stages.hf.tokenizer",
    "save_tokenizer": "stages.hf.tokenizer",
    "train_tokenizer": "stages.hf.tokenizer",
}

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "export_hf",
    "load_hf",
    "load_model",
    "load_tokenizer",
    "save_tokenizer",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(name)
    return getattr(importlib.import_module(_HOME[name]), name)
