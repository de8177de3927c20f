"""On-disk layout of checkpoints and the commit protocol.

A storage directory holds only complete checkpoints under their final names::

    <storage>/step_000000120/          complete: DCP files + COMMIT_NAME, written last
    <storage>/.tmp-<label>-step_.../   a save in progress (or killed): never listed
    <storage>/.trash-step_.../         a checkpoint being deleted: never listed
    <storage>/ito_reads.jsonl          one line per checkpoint load: which, by whom, when

A save writes into a temp folder; when DCP has written and fsynced every file and
its ``.metadata``, the coordinator writes the commit record, fsyncs it and the
folder, renames the folder to its final name (atomic on POSIX) and fsyncs the
parent. A process killed at any point leaves either a temp folder (swept later)
or a complete checkpoint, never a listed partial one. Deletion renames to a trash
name first, so a half-deleted checkpoint is never listed either.

Everything here works without torch.distributed, so the API can list and clean up.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from pydantic import Field

from stages.atomic_write import fsync_dir
from stages.base import StrictModel
from stages.checkpointing.seal import (
    COMMIT_NAME,
    FileDigest,
    SealBinding,
    digest_bytes,
    mark_phase,
    marked_phase,
    seal_key,
    write_seal,
)
from stages.errors import ErrorCode, ItoError
from stages.events import CheckpointEvent

DCP_METADATA_NAME = ".metadata"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
READ_LOG_NAME = "ito_reads.jsonl"
_FINAL_RE = re.compile(r"^step_(\d{9,})$")
_LABEL_RE = re.compile(r"[^A-Za-z0-9_.-]")


class CheckpointRecord(StrictModel):
    """A complete checkpoint, as listed (read back from its commit record)."""

    step: int = Field(ge=0)
    path: str
    bytes: int = Field(ge=0)
    blocking_s: float = Field(
        ge=0,
        description="time the training loop was blocked "
        "(save() and wait_staged(), a wait for the previous save included)",
    )
    staged_s: float = Field(
        default=0.0, ge=0, description="start of the save until the state copy was complete"
    )
    total_s: float = Field(ge=0, description="start of the save to commit")
    bytes_per_s: float = Field(ge=0, description="bytes / total_s")
    created_at: float = Field(description="unix time of the commit")
    run_label: str = ""

    def to_event(self, stage: str = "checkpointing") -> CheckpointEvent:
        return CheckpointEvent(
            stage=stage,
            step=self.step,
            path=self.path,
            bytes=self.bytes,
            blocking_s=self.blocking_s,
            total_s=self.total_s,
        )


def final_name(step: int) -> str:
    return f"step_{step:09d}"


def tmp_name(step: int, label: str) -> str:
    safe = _LABEL_RE.sub("_", label) or "run"
    return f"{TMP_PREFIX}{safe}-{final_name(step)}-{uuid.uuid4().hex[:8]}"


def tmp_prefix(label: str) -> str:
    return f"{TMP_PREFIX}{_LABEL_RE.sub('_', label) or 'run'}-"


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def commit(
    tmp_dir: Path,
    final_dir: Path,
    record: CheckpointRecord,
    seal_key: bytes,
    binding: SealBinding,
    written: dict[str, FileDigest],
) -> CheckpointRecord:
    """Write ``tmp_dir``'s commit record, seal it (``seal.py``: bound to ``binding``;
    ``written`` is every file's digest as its writer wrote it) and publish it as
    ``final_dir``.

    ``record.path`` and ``record.bytes`` are filled in here. An existing checkpoint
    at ``final_dir`` (same step, an abandoned timeline) is replaced.
    """
    if DCP_METADATA_NAME not in written or not (tmp_dir / DCP_METADATA_NAME).is_file():
        raise ItoError(
            ErrorCode.checkpoint_corrupt,
            f"{tmp_dir.name}: DCP metadata missing; refusing to commit",
        )
    data_bytes = sum(d.bytes for d in written.values())
    record = record.model_copy(
        update={
            "path": str(final_dir),
            "bytes": data_bytes,
            "bytes_per_s": data_bytes / max(record.total_s, 1e-9),
        }
    )
    raw = record.model_dump_json().encode()
    # O_EXCL | O_NOFOLLOW: a file or symlink planted under this name in the temp
    # folder fails the save instead of being written through.
    fd = os.open(
        tmp_dir / COMMIT_NAME,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
    )
    try:
        os.write(fd, raw)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_seal(tmp_dir, seal_key, binding, {**written, COMMIT_NAME: digest_bytes(raw)})
    fsync_dir(tmp_dir)
    if final_dir.exists():
        _trash(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    return record


def read_record(ckpt_dir: Path) -> CheckpointRecord | None:
    """The record of a complete checkpoint folder, or None if it is not one."""
    if not _FINAL_RE.match(ckpt_dir.name) or not (ckpt_dir / DCP_METADATA_NAME).is_file():
        return None
    try:
        record = CheckpointRecord.model_validate_json((ckpt_dir / COMMIT_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    # The folder may have moved (storage remounted): the path on disk is the truth.
    return record.model_copy(update={"path": str(ckpt_dir)})


def _root(storage_dir: str | Path) -> Path:
    """A folder path, or a policy's ``file:///abs/path`` storage URI."""
    if isinstance(storage_dir, str) and storage_dir.startswith("file://"):
        return Path(storage_dir.removeprefix("file://"))
    return Path(storage_dir)


def list_checkpoints(storage_dir: str | Path) -> list[CheckpointRecord]:
    """Complete checkpoints in ``storage_dir`` (a path or ``file://`` URI), oldest first."""
    root = _root(storage_dir)
    if not root.is_dir():
        return []
    records = [r for p in root.iterdir() if p.is_dir() and (r := read_record(p)) is not None]
    return sorted(records, key=lambda r: r.step)


class CheckpointRead(StrictModel):
    """One load of a checkpoint (the storage's read ledger)."""

    step: int
    reader: str
    at: float


def note_read(record: CheckpointRecord, reader: str) -> None:
    """Append a load of ``record`` to its storage's read ledger (one short O_APPEND
    write, so concurrent readers never interleave lines)."""
    line = CheckpointRead(step=record.step, reader=reader, at=time.time()).model_dump_json()
    fd = os.open(
        Path(record.path).parent / READ_LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
    )
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_log(storage_dir: str | Path) -> list[CheckpointRead]:
    """Every checkpoint load recorded in ``storage_dir``, oldest first."""
    path = _root(storage_dir) / READ_LOG_NAME
    if not path.is_file():
        return []
    return [
        CheckpointRead.model_validate_json(line)
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def _trash(ckpt_dir: Path) -> None:
    trash = ckpt_dir.with_name(f"{TRASH_PREFIX}{ckpt_dir.name}-{uuid.uuid4().hex[:8]}")
    os.rename(ckpt_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)


def delete_checkpoint(record: CheckpointRecord) -> None:
    """Remove one checkpoint; it disappears from listings atomically."""
    path = Path(record.path)
    if read_record(path) is None:
        raise ItoError(ErrorCode.checkpoint_not_found, f"no complete checkpoint at {path.name}")
    _trash(path)


def sweep_incomplete(
    storage_dir: str | Path, *, label: str | None = None, older_than_s: float = 0.0
) -> list[Path]:
    """Remove temp folders of killed saves (only ``label``'s when given) and trash.

    ``older_than_s`` spares temp folders modified more recently (a save that may
    still be running in another process).
    """
    root = _root(storage_dir)
    if not root.is_dir():
        return []
    prefix = TMP_PREFIX if label is None else tmp_prefix(label)
    now = time.time()
    removed = []
    for p in root.iterdir():
        if not p.is_dir():
            continue
        leftover = p.name.startswith(prefix) or p.name.startswith(TRASH_PREFIX)
        if not leftover:
            continue
        with contextlib.suppress(FileNotFoundError):
            if older_than_s and now - p.stat().st_mtime < older_than_s:
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def storage_usage(storage_dir: str | Path) -> dict[str, int]:
    """Bytes in complete checkpoints and in leftovers (for cleanup reports)."""
    root = _root(storage_dir)
    complete = sum(r.bytes for r in list_checkpoints(root))
    leftovers = 0
    if root.is_dir():
        leftovers = sum(
            folder_bytes(p)
            for p in root.iterdir()
            if p.is_dir() and p.name.startswith((TMP_PREFIX, TRASH_PREFIX))
        )
    return {"complete_bytes": complete, "leftover_bytes": leftovers}


def pin_phase(record: CheckpointRecord, phase: str, key: bytes | None = None) -> None:
    """Mark ``record`` as the checkpoint that closed ``phase``: keep-K never deletes it.
    The mark carries a MAC over the phase and the checkpoint's seal (``seal.py``)."""
    mark_phase(Path(record.path), seal_key() if key is None else key, phase)


def pinned_phase(record: CheckpointRecord, key: bytes | None = None) -> str | None:
    """The phase ``record`` closes, or None (no mark, or one this backend did not write
    for this very checkpoint)."""
    return marked_phase(Path(record.path), seal_key() if key is None else key)
