"""Load and save the policy as a local HF folder (model + the run's tokenizer, stages.hf)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from stages.errors import ErrorCode, ItoError


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


def load_tokenizer(path: Path) -> Any:
    """The run's tokenizer (``stages.hf``): local files only, pad and chat template set."""
    from stages.hf import load_tokenizer as load

    return load(path)


# transformers' model loading patches process-wide state (weight init): two loads at
# once in one process (a rollout worker's background load beside another) can leave
# weights unset. One at a time.
_LOAD_LOCK = threading.Lock()


def load_model(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, dtype=torch.float32
        )
    model.config.use_cache = True
    return model


def save(model: Any, tokenizer: Any, path: Path, **metadata: Any) -> str:
    """An HF export (``stages.hf.export_hf``: atomic, with each file's sha256)."""
    from stages.hf import export_hf

    return str(export_hf(model, tokenizer, path, metadata=metadata))
