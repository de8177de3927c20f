"""Hugging Face formats: the run's tokenizer and model exports that lm-eval, trl and
users load with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(dir)``."""

from stages.hf.export import export_hf, load_hf
from stages.hf.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "export_hf",
    "load_hf",
    "load_tokenizer",
    "save_tokenizer",
    "train_tokenizer",
]
