"""The run's tokenizer as a ``PreTrainedTokenizerFast`` (pad/bos/eos/unk, chat
template): the BPE of ``stages.hf.bpe`` wrapped for the ranks, trl and lm-eval, saved
and loaded in the ``save_pretrained`` layout."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from stages.errors import ErrorCode, ItoError
from stages.hf.bpe import CHAT_TEMPLATE, SPECIAL_TOKENS, train_bpe


def _wrap(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: unannotated
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        **SPECIAL_TOKENS,
    )


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """``stages.hf.bpe.train_bpe``'s tokenizer, wrapped (deterministic; ``vocab_size
    == 260`` is the pure byte tokenizer)."""
    bpe = train_bpe(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    return _wrap(bpe, model_max_length)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return out


# tokenizer_config.json classes that are the tokenizers-library backend itself.
FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_class(folder: Path) -> str | None:
    try:
        doc = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc.get("tokenizer_class") if isinstance(doc, dict) else None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A local tokenizer folder (``save_pretrained`` layout, or ``stages.hf.bpe``'s);
    never the hub."""
    p = Path(path)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ItoError(ErrorCode.tokenizer_invalid, f"no tokenizer files in {p}")
    tok: PreTrainedTokenizerBase
    if _declared_class(p) in FAST_CLASSES and (p / "tokenizer.json").is_file():
        # The class AutoTokenizer would pick, without reading the model's config: that
        # imports transformers' model utilities, and torch with them (the driver,
        # which tokenizes RLVR prompts, never loads torch).
        tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    else:
        from transformers import AutoTokenizer  # its module imports the model config's

        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHAT_TEMPLATE
    return tok
