"""Hugging Face model folders, tokenizer beside the weights: from an in-memory model
(``export_hf``) or streamed from a sealed DCP checkpoint (``export_hf_from_checkpoint``,
a phase's export: no rank ever holds more than one safetensors shard of it).

Either is written into a staging folder beside the target and renamed into place, so
a crash leaves no export or a complete one; ``ito_export.json`` lists each file's
sha256 and the caller's ``metadata`` (run, phase, step). The staging folder lies in
the tenant-writable checkpoint root: it is reached, written and renamed without
following a symlink (``stages/hf/staging.py``).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from stages.errors import ErrorCode, ItoError
from stages.hf.staging import Staging
from stages.hf.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from stages.checkpointing.sealed import SealedCheckpoint

EXPORT_META = "ito_export.json"
# The most bytes of weights one shard file (and so the exporting process) holds.
SHARD_BYTES = 2 << 30
# Where a training checkpoint keeps the model's state dict (``TrainState``'s "model").
CHECKPOINT_MODEL_PREFIX = "train.model."


def staging_dir(out_dir: str | Path, token: str) -> Path:
    """Where an export of ``out_dir`` is assembled before its rename: one folder every
    writer of the export agrees on by ``token``."""
    out = Path(out_dir)
    return out.with_name(f".{out.name}.tmp-{token}")


def _publish(staging: Staging, out_dir: str | Path, metadata: dict[str, Any] | None) -> Path:
    """Write the sha256 list of the staged files and put the folder in place of
    ``out_dir`` (one rename)."""
    out = Path(out_dir)
    staging.discard(EXPORT_META)  # written below: a stale one is not a staged file
    files = staging.sha256s()
    meta = json.dumps({"files": files, **(metadata or {})}, indent=2, sort_keys=True)
    staging.write_bytes(EXPORT_META, meta.encode())
    staging.publish(out)
    return out


@contextmanager
def _published(out_dir: str | Path, metadata: dict[str, Any] | None) -> Iterator[Path]:
    """A private temp folder to fill; on success its files are staged beside
    ``out_dir`` and the staging folder replaces it (``_publish``)."""
    with Staging(staging_dir(out_dir, str(os.getpid())), fresh=True) as staging:
        try:
            with tempfile.TemporaryDirectory(prefix="ito-export-") as private:
                yield Path(private)
                staging.copy_in(Path(private))
            _publish(staging, out_dir, metadata)
        except BaseException:
            staging.remove()
            raise


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
        hf.eval()  # type: ignore[no-untyped-call]  # transformers: unannotated
        try:
            hf.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        finally:
            hf.train(was_training)
    return Path(out_dir)


class ExportPlan:
    """The files of a checkpoint's HF export: which tensors go into which shard."""

    def __init__(self, checkpoint: SealedCheckpoint, config: PretrainedConfig, shard_bytes: int):
        with torch.device("meta"):  # the names, ties and configs; no weights
            self.shape = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        tied = (
            set(getattr(self.shape, "_tied_weights_keys", None) or ())
            if getattr(config, "tie_word_embeddings", False)
            else set()
        )
        stored = checkpoint.tensors()
        self.names = [n for n in self.shape.state_dict() if n not in tied]
        missing = [n for n in self.names if CHECKPOINT_MODEL_PREFIX + n not in stored]
        if missing:
            raise ItoError(
                ErrorCode.checkpoint_corrupt,
                f"checkpoint {checkpoint.path.name} lacks {len(missing)} weights of the "
                f"model, e.g. {missing[0]}",
            )
        self.meta = {n: stored[CHECKPOINT_MODEL_PREFIX + n] for n in self.names}  # size, dtype
        self.nbytes = {n: size.numel() * dtype.itemsize for n, (size, dtype) in self.meta.items()}
        self.shards = _shards(self.names, self.nbytes, shard_bytes)
        n = len(self.shards)
        self.files = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )


def export_shards(
    checkpoint: SealedCheckpoint,
    config: PretrainedConfig,
    tmp: Path,
    *,
    part: int = 0,
    parts: int = 1,
    shard_bytes: int = SHARD_BYTES,
) -> list[str]:
    """Write part ``part`` of ``parts`` of the export's safetensors shards (every
    ``parts``-th shard from the ``part``-th) into the staging folder ``tmp``, reading
    from the checkpoint only the tensors they hold; returns the files written. Each
    writer holds at most ``shard_bytes`` of weights at a time, whatever layout saved
    them (FSDP2, TP or PP shards are read back in their global shape)."""
    plan = ExportPlan(checkpoint, config, shard_bytes)
    written = []
    with Staging(tmp) as staging:
        for i in range(part, len(plan.shards), parts):
            shard, file = plan.shards[i], plan.files[i]
            tensors = {n: torch.empty(plan.meta[n][0], dtype=plan.meta[n][1]) for n in shard}
            checkpoint.load({CHECKPOINT_MODEL_PREFIX + n: t for n, t in tensors.items()})
            # A temp name, then a rename: a half-written shard never has the file's name.
            staging.save_tensors(file, tensors)
            written.append(file)
            del tensors
    return written


def finish_export(
    checkpoint: SealedCheckpoint,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    tmp: Path,
    out_dir: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Complete the export staged in ``tmp`` (every shard written, ``export_shards``):
    the shard index, config, generation config and tokenizer, the sha256 list, then
    one rename into ``out_dir``. Refused if a shard is missing; on any failure the
    staging folder is removed."""
    with Staging(tmp) as staging:
        try:
            return _finish(checkpoint, config, tokenizer, staging, out_dir, metadata, shard_bytes)
        except BaseException:
            staging.remove()
            raise


def _finish(
    checkpoint: SealedCheckpoint,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    staging: Staging,
    out_dir: str | Path,
    metadata: dict[str, Any] | None,
    shard_bytes: int,
) -> Path:
    """``finish_export``'s work, in its open staging folder."""
    plan = ExportPlan(checkpoint, config, shard_bytes)
    missing = [f for f in plan.files if not staging.has_file(f)]
    if missing:
        raise ItoError(
            ErrorCode.checkpoint_corrupt,
            f"export of {checkpoint.path.name}: {len(missing)} shard(s) not written, "
            f"e.g. {missing[0]}",
        )
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": sum(plan.nbytes.values())},
            "weight_map": {
                n: f for shard, f in zip(plan.shards, plan.files, strict=True) for n in shard
            },
        }
        staging.write_bytes(
            "model.safetensors.index.json",
            (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(),
        )
    saved = copy.deepcopy(config)
    saved.architectures = [type(plan.shape).__name__]
    saved.dtype = plan.meta[plan.names[0]][1]
    with tempfile.TemporaryDirectory(prefix="ito-export-") as private:
        saved.save_pretrained(private)
        if plan.shape.can_generate() and plan.shape.generation_config is not None:
            plan.shape.generation_config.save_pretrained(private)
        tokenizer.save_pretrained(private)
        staging.copy_in(Path(private))
    return _publish(staging, out_dir, metadata)


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
    safetensors shards with their index), the tokenizer beside it, written by this
    process alone (``export_shards`` for every shard, then ``finish_export``; a phase
    end splits the shards over the ranks instead, torchtitan's HF-format last save)."""
    tmp = staging_dir(out_dir, str(os.getpid()))
    with Staging(tmp, fresh=True) as staging:
        try:
            export_shards(checkpoint, config, tmp, shard_bytes=shard_bytes)
        except BaseException:
            staging.remove()
            raise
    return finish_export(
        checkpoint, config, tokenizer, tmp, out_dir, metadata=metadata, shard_bytes=shard_bytes
    )


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


# transformers' model loading patches process-wide state (weight init): two loads at
# once in one process (a rollout worker's background load beside another) can leave
# weights unset. One at a time.
_LOAD_LOCK = threading.Lock()


def load_model(path: str | Path) -> PreTrainedModel:
    """The model of an HF folder in fp32, local files only, its KV cache on (it is
    scored or generates from)."""
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, dtype=torch.float32
        )
    model.config.use_cache = True
    return model


def load_hf(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of an export folder, local files only."""
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return model, load_tokenizer(path)
