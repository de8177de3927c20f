"""Load and save the policy as a local HF folder (model + the run's tokenizer, stages.hf)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.errors import ErrorCode, ItoError


def model_dir(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def check_model_dir(path: Path) -> None:
    if not path.is_absolute():
        raise ItoError(ErrorCode.post_training_model_invalid, "base_model must be absolute")
    need = ["config.json", "tokenizer_config.json"]
    missing = [n for n in need if not (path / n).is_file()]
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    if missing or not weights:
        raise ItoError(ErrorCode.post_training_model_invalid,
                       f"{path.name}: not an HF model folder (missing "
                       f"{', '.join(missing + ([] if weights else ['weights']))})")


def load_tokenizer(path: Path) -> Any:
    """The run's tokenizer (``stages.hf``): local files only, pad and chat template set."""
    from stages.hf import load_tokenizer as load

    return load(path)


def load_model(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                 dtype=torch.float32)
    model.config.use_cache = True
    return model


def save(model: Any, tokenizer: Any, path: Path, **metadata: Any) -> str:
    """An HF export (``stages.hf.export_hf``: atomic, with each file's sha256)."""
    from stages.hf import export_hf

    return str(export_hf(model, tokenizer, path, metadata=metadata))
