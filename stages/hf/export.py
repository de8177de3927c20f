"""Export in-memory weights as a Hugging Face model folder, tokenizer beside them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from stages.hf.tokenizer import load_tokenizer

EXPORT_META = "ito_export.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def export_hf(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """``save_pretrained`` the model (safetensors) and the tokenizer into ``out_dir``.

    Written into a temp folder beside it and renamed into place, so a crash leaves
    either no export or a complete one; ``ito_export.json`` lists each file's sha256
    and the caller's ``metadata`` (run, phase, step).
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError("export_hf needs a transformers PreTrainedModel")
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    was_training = model.training
    model.eval()
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    finally:
        model.train(was_training)
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / EXPORT_META).write_text(
        json.dumps({"files": files, **(metadata or {})}, indent=2, sort_keys=True)
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_hf(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of an export folder, local files only."""
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return model, load_tokenizer(path)
