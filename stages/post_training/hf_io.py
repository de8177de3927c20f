"""Load the policy from a local HF folder (model + the run's tokenizer, stages.hf)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stages.errors import ErrorCode, ItoError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def model_dir(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def check_model_dir(files: list[str]) -> None:
    """The folder's files (relative paths, from the walk that read them) make an HF
    model: config, tokenizer config and weights at its top level."""
    top = {f for f in files if "/" not in f}
    missing = [n for n in ("config.json", "tokenizer_config.json") if n not in top]
    weights = [
        f
        for f in top
        if f.endswith(".safetensors") or (f.startswith("pytorch_model") and f.endswith(".bin"))
    ]
    if missing or not weights:
        raise ItoError(
            ErrorCode.post_training_model_invalid,
            "base_model is not an HF model folder (missing "
            f"{', '.join(missing + ([] if weights else ['weights']))})",
        )


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The run's tokenizer (``stages.hf``): local files only, pad and chat template set."""
    from stages.hf import load_tokenizer as load

    return load(path)


def load_model(path: Path) -> PreTrainedModel:
    """The policy of an HF folder in fp32 (``stages.hf.load_model``)."""
    from stages.hf import load_model as load

    return load(path)
