"""Checkpoints are data, not code, and belong to one run: each carries a seal this
backend wrote.

DCP unpickles a checkpoint's ``.metadata`` on load, and its planner unpickles every
non-tensor item of the data files, so a tenant who can write into its checkpoint
root could otherwise run code on the booking's nodes (which hold the launch key and
the Ray token); and a checkpoint of another run or account copied into a root would
otherwise be resumed as the newest. At save the coordinator writes ``ito_seal.json``:
what the checkpoint belongs to (run, account, phase, step), the size and BLAKE3 of
every file of it (the commit record ``ito_commit.json`` included; the digests are
taken from the bytes as the writers wrote them, ``sealing_writer.py``), and an
HMAC-SHA256 over all of it. The phase mark ``ito_phase.json`` (written later, when a
phase's gate closes on the checkpoint) carries an HMAC of its own over the phase,
the step and the seal's MAC, so it belongs to that one sealed checkpoint.

A load (``SealedCheckpoint``) checks the seal, what it is bound to, the folder's
listing, and ``.metadata``'s digest before anything is unpickled (``.metadata`` is
unpickled from the very bytes that were checked); a data file is checked when it is
first opened, so a rank hashes only the files it reads. Non-tensor items are read
with ``torch.load(weights_only=True)``, so even a data file replaced after its check
can at worst change numbers, never run code.

The key is derived from the deployment's launch key (``stages/keys.py``) with a
label of its own: every node that trains already holds that file (nothing new to
distribute), tenants never can, and a seal is never a valid launch ticket or the
reverse. Rotating the launch key makes older checkpoints untrusted (by design).

Torch-free: the API lists checkpoints without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import stat
from pathlib import Path
from typing import Literal

import blake3
from pydantic import Field, ValidationError

from stages.base import StrictModel
from stages.errors import ErrorCode, ItoError
from stages.keys import read_launch_key
from stages.run_facts import RunFacts

SEAL_NAME = "ito_seal.json"
COMMIT_NAME = "ito_commit.json"
PHASE_MARK_NAME = "ito_phase.json"
PHASE_MARK_TMP = f".{PHASE_MARK_NAME}.tmp"
METADATA_NAME = ".metadata"
# The seal itself and the phase mark (which carries its own MAC): outside the file list.
UNSEALED = frozenset({SEAL_NAME, PHASE_MARK_NAME, PHASE_MARK_TMP})
SEAL_VERSION: Literal[2] = 2
_KEY_LABEL = b"ito checkpoint seal v1"
_CHUNK = 8 << 20
# A checkpoint is a few files per rank; a folder with more is not one of ours.
MAX_FILES = 100_000
MAX_SEAL_BYTES = 64 << 20
# .metadata is held in memory to be unpickled from the checked bytes.
MAX_METADATA_BYTES = 1 << 30
# Commit records and phase marks are a few hundred bytes.
MAX_RECORD_BYTES = 1 << 20


class FileDigest(StrictModel):
    bytes: int = Field(ge=0)
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")


def file_hasher(*, threads: bool = False) -> blake3.blake3:
    """A file digest in progress: BLAKE3-256 (its SIMD runs ~5x SHA-256's speed on one
    core, and ``update`` releases the GIL); ``threads``: on every core (a load, where
    the rank waits for it)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)


class CheckpointBinding(StrictModel):
    """The run a checkpoint belongs to (the Checkpointer's, for every save and load)."""

    run_id: str = Field(default="", max_length=256)
    account: str = Field(default="", max_length=256)


def run_binding(run_id: str, facts: RunFacts) -> CheckpointBinding:
    """The binding of run ``run_id`` whose facts are ``facts`` (their ``account``: the
    signed launch spec's)."""
    return CheckpointBinding(run_id=run_id, account=facts.account)


class SealBinding(CheckpointBinding):
    """What one checkpoint is: its run, account, the curriculum phase its step belongs
    to, and the step."""

    phase: str = Field(default="", max_length=256)
    step: int = Field(ge=0)


class Seal(StrictModel):
    version: Literal[2]
    binding: SealBinding
    files: dict[str, FileDigest]
    mac: str = Field(pattern=r"^[0-9a-f]{64}$")


class PhaseMark(StrictModel):
    phase: str = Field(max_length=256)
    step: int = Field(ge=0)
    mac: str = Field(pattern=r"^[0-9a-f]{64}$")


def seal_key() -> bytes:
    """The deployment's checkpoint key (raises ``checkpoint_untrusted`` without one)."""
    return hmac.new(
        read_launch_key(ErrorCode.checkpoint_untrusted), _KEY_LABEL, hashlib.sha256
    ).digest()


def _seal_mac(key: bytes, binding: SealBinding, files: dict[str, FileDigest]) -> str:
    body = json.dumps(
        {
            "version": SEAL_VERSION,
            "binding": binding.model_dump(mode="json"),
            "files": {k: [v.bytes, v.blake3] for k, v in sorted(files.items())},
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hmac.new(key, b"seal\0" + body.encode(), hashlib.sha256).hexdigest()


def _mark_mac(key: bytes, phase: str, step: int, seal_mac: str) -> str:
    body = json.dumps([phase, step, seal_mac], separators=(",", ":"))
    return hmac.new(key, b"phase\0" + body.encode(), hashlib.sha256).hexdigest()


def untrusted(folder: Path, why: str) -> ItoError:
    return ItoError(
        ErrorCode.checkpoint_untrusted,
        f"checkpoint {folder.name} was not written by this backend ({why}); "
        "nothing of it was loaded",
    )


def open_dir(folder: Path) -> int:
    """The checkpoint folder, opened without following a symlink in its place."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise untrusted(
            folder, "not a folder" if e.errno in (errno.ENOTDIR, errno.ELOOP) else "unreadable"
        ) from None


def entries(folder: Path, dir_fd: int) -> list[str]:
    """The folder's files; anything else in it (a symlink, a subfolder) is refused."""
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            if not entry.is_file(follow_symlinks=False):
                raise untrusted(folder, "it holds something other than plain files")
            names.append(entry.name)
            if len(names) > MAX_FILES:
                raise untrusted(folder, "too many files")
    return names


def open_file(dir_fd: int, name: str) -> int:
    """A regular file of the folder, never through a symlink, never blocking on a FIFO."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def digest_fd(fd: int, *, keep_up_to: int = 0) -> tuple[FileDigest, bytes]:
    """Size and digest of an open file from its start; its bytes too with
    ``keep_up_to`` (``EFBIG`` beyond it)."""
    h, size, kept = file_hasher(threads=True), 0, bytearray()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, _CHUNK):
        h.update(chunk)
        size += len(chunk)
        if keep_up_to:
            if size > keep_up_to:
                raise OSError(errno.EFBIG, "file too large")
            kept += chunk
    return FileDigest(bytes=size, blake3=h.hexdigest()), bytes(kept)


def write_seal(
    folder: Path, key: bytes, binding: SealBinding, written: dict[str, FileDigest]
) -> Seal:
    """Seal ``folder`` (after DCP finished and the commit record is written, before the
    rename). ``written`` holds the digest of every file as its writer wrote it: a file
    the folder holds beyond them (planted in the temp folder during the save), or one
    whose size changed since, is refused, never sealed; one changed in place at the
    same size fails its check at load."""
    dir_fd = open_dir(folder)
    try:
        names = {n for n in entries(folder, dir_fd) if n not in UNSEALED}
        if names != set(written) or METADATA_NAME not in names or COMMIT_NAME not in names:
            raise untrusted(folder, "its files are not the ones its writers wrote")
        for name in names:
            try:
                size = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
            except OSError:
                raise untrusted(folder, "a written file is unreadable") from None
            if size != written[name].bytes:
                raise untrusted(folder, "a file changed after it was written")
    finally:
        os.close(dir_fd)
    seal = Seal(
        version=SEAL_VERSION, binding=binding, files=written, mac=_seal_mac(key, binding, written)
    )
    with (folder / SEAL_NAME).open("x") as f:
        f.write(seal.model_dump_json())
        f.flush()
        os.fsync(f.fileno())
    return seal


def read_seal(folder: Path, dir_fd: int, key: bytes) -> Seal:
    """The folder's seal, its MAC checked (``checkpoint_untrusted``; an older format:
    ``checkpoint_seal_outdated``)."""
    try:
        raw = read_small(dir_fd, SEAL_NAME, MAX_SEAL_BYTES)
        doc = json.loads(raw)
    except (OSError, ValueError):
        raise untrusted(folder, "no valid seal") from None
    if isinstance(doc, dict) and doc.get("version", 1) == 1 and "binding" not in doc:
        raise ItoError(
            ErrorCode.checkpoint_seal_outdated,
            f"checkpoint {folder.name} carries a seal of an older format that does not "
            "bind it to its run; nothing of it was loaded (re-save it to keep it)",
        )
    try:
        seal = Seal.model_validate(doc)
    except ValidationError:
        raise untrusted(folder, "no valid seal") from None
    if not hmac.compare_digest(_seal_mac(key, seal.binding, seal.files), seal.mac):
        raise untrusted(folder, "the seal does not verify")
    return seal


def check_binding(
    folder: Path,
    seal: Seal,
    run: CheckpointBinding,
    *,
    step: int | None = None,
    phase: str | None = None,
) -> None:
    """``checkpoint_foreign`` unless ``seal`` is bound to ``run`` (and to ``step`` and
    ``phase`` where given)."""
    got = seal.binding
    why = ""
    if got.run_id != run.run_id or got.account != run.account:
        why = "it was sealed for another run or account"
    elif step is not None and got.step != step:
        why = f"it was sealed at step {got.step}, not {step}"
    elif phase is not None and got.phase != phase:
        why = f"it was sealed in phase {got.phase!r}, not {phase!r}"
    if why:
        raise ItoError(
            ErrorCode.checkpoint_foreign,
            f"checkpoint {folder.name} does not belong here ({why}); nothing of it was loaded",
        )


def check_record_step(folder: Path, seal: Seal, record: bytes) -> None:
    """The (checked) commit record names the sealed step."""
    try:
        step = json.loads(record)["step"]
    except (ValueError, KeyError, TypeError):
        raise untrusted(folder, "its commit record is unreadable") from None
    if step != seal.binding.step:
        raise untrusted(folder, "its commit record names another step")


def check_listing(folder: Path, dir_fd: int, seal: Seal) -> None:
    """The folder holds exactly the sealed files (plain files, nothing added)."""
    names = {n for n in entries(folder, dir_fd) if n not in UNSEALED}
    if names != set(seal.files) or not {METADATA_NAME, COMMIT_NAME} <= names:
        raise untrusted(folder, "its files differ from the sealed ones")


def read_checked(folder: Path, dir_fd: int, seal: Seal, name: str, limit: int) -> bytes:
    """The whole of a small sealed file, from the one read that was checked."""
    try:
        fd = open_file(dir_fd, name)
        try:
            got, kept = digest_fd(fd, keep_up_to=limit)
        finally:
            os.close(fd)
    except OSError:
        raise untrusted(folder, "a sealed file is unreadable") from None
    if got != seal.files.get(name):
        raise untrusted(folder, "a file changed after it was sealed")
    return kept


def check_open_file(folder: Path, fd: int, seal: Seal, name: str) -> None:
    """An open data file against its digest (the descriptor is left at its start)."""
    try:
        got, _ = digest_fd(fd)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        raise untrusted(folder, "a sealed file is unreadable") from None
    if got != seal.files.get(name):
        raise untrusted(folder, "a file changed after it was sealed")


def digest_bytes(data: bytes) -> FileDigest:
    return FileDigest(bytes=len(data), blake3=file_hasher().update(data).hexdigest())


def mark_phase(folder: Path, key: bytes, phase: str) -> None:
    """Write ``folder``'s phase mark for ``phase`` (its seal checked first)."""
    dir_fd = open_dir(folder)
    try:
        seal = read_seal(folder, dir_fd, key)
        step = seal.binding.step
        mark = PhaseMark(phase=phase, step=step, mac=_mark_mac(key, phase, step, seal.mac))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(PHASE_MARK_TMP, dir_fd=dir_fd)
        fd = os.open(
            PHASE_MARK_TMP,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=dir_fd,
        )
        try:
            os.write(fd, mark.model_dump_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(PHASE_MARK_TMP, PHASE_MARK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def marked_phase(folder: Path, key: bytes) -> str | None:
    """The phase ``folder`` closes, when its mark verifies against its seal; else None
    (no mark, or one written or copied there by anyone but this backend)."""
    try:
        dir_fd = open_dir(folder)
    except ItoError:
        return None
    try:
        mark = PhaseMark.model_validate_json(read_small(dir_fd, PHASE_MARK_NAME, MAX_RECORD_BYTES))
        seal = read_seal(folder, dir_fd, key)
    except (OSError, ValueError, ItoError):
        return None
    finally:
        os.close(dir_fd)
    want = _mark_mac(key, mark.phase, mark.step, seal.mac)
    if mark.step != seal.binding.step or not hmac.compare_digest(want, mark.mac):
        return None
    return mark.phase


def read_small(dir_fd: int, name: str, limit: int) -> bytes:
    fd = open_file(dir_fd, name)
    try:
        raw = b""
        while len(raw) <= limit and (chunk := os.read(fd, limit + 1 - len(raw))):
            raw += chunk
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise OSError(errno.EFBIG, "file too large")
    return raw
