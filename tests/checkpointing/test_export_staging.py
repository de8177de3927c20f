"""A phase's HF export is staged in the tenant-writable checkpoint root: a symlink
planted on its path, in place of the staging folder or of a file in it, is never
followed (nothing is written outside the folder the safe walk opened).

Each test plants the symlink the way a tenant with write access to its checkpoint
root could, runs the real export from a real sealed llama-tiny checkpoint, and
checks the folder the symlink pointed at. The old staging code made its folder with
``mkdir(parents=True, exist_ok=True)`` and wrote by path: it wrote through each one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.checkpointing import Checkpointer, CheckpointPolicy
from stages.checkpointing.seal import CheckpointBinding, seal_key
from stages.checkpointing.sealed import SealedCheckpoint
from stages.errors import ErrorCode, ItoError
from stages.hf import train_tokenizer
from stages.hf.export import export_hf, export_shards, finish_export, staging_dir
from stages.model.lm import build_model, llama_config
from stages.presets import load_model_preset

TEXTS = [f"def f{i}(x):\n    return x * {i} + the_answer\n" for i in range(40)]


@pytest.fixture(scope="module")
def closing(tmp_path_factory: pytest.TempPathFactory) -> tuple[SealedCheckpoint, Any, Any]:
    root = tmp_path_factory.mktemp("export_ckpt")
    preset = load_model_preset("llama-tiny")
    model = build_model(preset, seed=3)
    policy = CheckpointPolicy(interval_steps=1, storage_uri=f"file://{root / 'ckpt'}")
    with Checkpointer(policy, async_staging=False) as ck:
        ck.save(5, {"train": {"model": model.state_dict(), "step": 5}})
        record = ck.wait()
    assert record is not None
    sealed = SealedCheckpoint(Path(record.path), seal_key(), CheckpointBinding())
    return sealed, llama_config(preset), train_tokenizer(TEXTS, vocab_size=260)


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("untouched")
    return out


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "untouched"


def test_a_symlink_in_place_of_the_staging_folder_is_refused(
    closing: tuple[SealedCheckpoint, Any, Any], tmp_path: Path
) -> None:
    sealed, config, _tok = closing
    outside = _outside(tmp_path)
    export = tmp_path / "root" / "hf" / "pretrain"
    stage = staging_dir(export, "tok")
    stage.parent.mkdir(parents=True)
    stage.symlink_to(outside)
    with pytest.raises(ItoError) as e:
        export_shards(sealed, config, stage)
    assert e.value.code == ErrorCode.checkpoint_storage_unwritable
    _untouched(outside)


def test_a_symlink_on_the_staging_folders_path_is_refused(
    closing: tuple[SealedCheckpoint, Any, Any], tmp_path: Path
) -> None:
    sealed, config, _tok = closing
    outside = _outside(tmp_path)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "hf").symlink_to(outside)  # the export's parent folder
    stage = staging_dir(tmp_path / "root" / "hf" / "pretrain", "tok")
    with pytest.raises(ItoError) as e:
        export_shards(sealed, config, stage)
    assert e.value.code == ErrorCode.checkpoint_storage_unwritable
    _untouched(outside)


def test_symlinks_planted_as_files_of_the_staging_folder_are_replaced_not_written_through(
    closing: tuple[SealedCheckpoint, Any, Any], tmp_path: Path
) -> None:
    sealed, config, tok = closing
    outside = _outside(tmp_path)
    export = tmp_path / "root" / "hf" / "pretrain"
    stage = staging_dir(export, "tok")
    stage.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "ito_export.json"):
        (stage / name).symlink_to(outside / "keep.txt")
    export.mkdir()  # a previous export, replaced by the rename
    assert export_shards(sealed, config, stage) == ["model.safetensors"]
    out = finish_export(sealed, config, tok, stage, export, metadata={"step": 5})
    _untouched(outside)
    assert not stage.exists()
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "ito_export.json"} <= files
    assert not any(p.is_symlink() for p in out.iterdir())
    meta = json.loads((out / "ito_export.json").read_text())
    assert meta["step"] == 5 and "model.safetensors" in meta["files"]


def test_a_symlink_in_place_of_an_in_memory_export_staging_folder_is_removed_not_followed(
    tmp_path: Path,
) -> None:
    outside = _outside(tmp_path)
    export = tmp_path / "root" / "hf" / "final"
    stage = staging_dir(export, str(os.getpid()))
    stage.parent.mkdir(parents=True)
    stage.symlink_to(outside)
    model = build_model(load_model_preset("llama-tiny"), seed=3)
    with torch.no_grad():
        out = export_hf(model, train_tokenizer(TEXTS, vocab_size=260), export)
    _untouched(outside)
    assert (out / "model.safetensors").is_file() and not stage.exists()
