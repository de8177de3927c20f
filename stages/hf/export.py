"""Hugging Face model folders, tokenizer beside the weights: from an in-memory model
(``export_hf``) or streamed from a sealed DCP checkpoint (``export_hf_from_checkpoint``,
a phase's export: no rank ever holds more than one safetensors shard of it).

Either is written into a temp folder beside the target and renamed into place, so a
crash leaves no export or a complete one; ``ito_export.json`` lists each file's
sha256 and the caller's ``metadata`` (run, phase, step).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from stages.errors import ErrorCode, ItoError
from stages.hf.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from stages.checkpointing.sealed import SealedCheckpoint

EXPORT_META = "ito_export.json"
# The most bytes of weights one shard file (and so the exporting process) holds.
SHARD_BYTES = 2 << 30
# Where a training checkpoint keeps the model's state dict (``TrainState``'s "model").
CHECKPOINT_MODEL_PREFIX = "train.model."


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _published(out_dir: str | Path, metadata: dict[str, Any] | None) -> Iterator[Path]:
    """A temp folder to fill; on success its sha256 list is written and it replaces
    ``out_dir`` (one rename)."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / EXPORT_META).write_text(
        json.dumps({"files": files, **(metadata or {})}, indent=2, sort_keys=True)
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def export_hf(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """``save_pretrained`` the model (safetensors) and the tokenizer into ``out_dir``
    (the repo's Llama through its HF view, ``stages.hf.view``)."""
    from stages.hf.view import as_hf

    hf: PreTrainedModel = as_hf(model)
    with _published(out_dir, metadata) as tmp:
        was_training = hf.training
        hf.eval()
        try:
            hf.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        finally:
            hf.train(was_training)
    return Path(out_dir)


def export_hf_from_checkpoint(
    checkpoint: SealedCheckpoint,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """The model a sealed training checkpoint holds, as the folder ``save_pretrained``
    writes for ``config``'s model (the same tensor names, config and generation config,
    safetensors shards with their index), the tokenizer beside it.

    The checkpoint's tensors are read a shard at a time into plain tensors of their
    global shape, whatever layout saved them (FSDP2, TP or PP shards): the exporting
    process holds at most ``shard_bytes`` of weights (torchtitan's HF-format last save
    does the same from the ranks' shards)."""
    with torch.device("meta"):  # the names, ties and configs; no weights
        shape = AutoModelForCausalLM.from_config(config)
    tied = (
        set(getattr(shape, "_tied_weights_keys", None) or ())
        if getattr(config, "tie_word_embeddings", False)
        else set()
    )
    stored = checkpoint.tensors()
    names = [n for n in shape.state_dict() if n not in tied]
    missing = [n for n in names if CHECKPOINT_MODEL_PREFIX + n not in stored]
    if missing:
        raise ItoError(
            ErrorCode.checkpoint_corrupt,
            f"checkpoint {checkpoint.path.name} lacks {len(missing)} weights of the "
            f"model, e.g. {missing[0]}",
        )
    meta = {n: stored[CHECKPOINT_MODEL_PREFIX + n] for n in names}  # (size, dtype)
    nbytes = {n: size.numel() * dtype.itemsize for n, (size, dtype) in meta.items()}
    shards = _shards(names, nbytes, shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with _published(out_dir, metadata) as tmp:
        for shard, file in zip(shards, files, strict=True):
            tensors = {n: torch.empty(meta[n][0], dtype=meta[n][1]) for n in shard}
            checkpoint.load({CHECKPOINT_MODEL_PREFIX + n: t for n, t in tensors.items()})
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(nbytes.values())},
                "weight_map": {n: f for shard, f in zip(shards, files, strict=True) for n in shard},
            }
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        saved = copy.deepcopy(config)
        saved.architectures = [type(shape).__name__]
        saved.dtype = meta[names[0]][1]
        saved.save_pretrained(str(tmp))
        if shape.can_generate() and shape.generation_config is not None:
            shape.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return Path(out_dir)


def _shards(names: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """``names`` in order, cut into runs of at most ``limit`` bytes (a larger tensor
    is a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if shards[-1] and size + nbytes[n] > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    return shards


def load_hf(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of an export folder, local files only."""
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return model, load_tokenizer(path)
