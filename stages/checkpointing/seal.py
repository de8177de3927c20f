"""Checkpoints are data, not code: each one carries a seal this backend wrote.

DCP unpickles a checkpoint's ``.metadata`` on load, and its planner unpickles every
non-tensor item of the data files, so a tenant who can write into its checkpoint
root could otherwise run code on the booking's nodes (which hold the launch key and
the Ray token). At save the coordinator writes ``ito_seal.json``: the size and
SHA-256 of every file of the checkpoint and an HMAC-SHA256 over them. A load checks
the seal, then every file against it, before anything is unpickled, and refuses
with ``checkpoint_untrusted`` (a planted folder, a tampered or added file, a folder
sealed under another key). What DCP then reads cannot be swapped in between:

* ``.metadata`` is unpickled from the very bytes that were checked;
* non-tensor items are read with ``torch.load(weights_only=True)``, which builds
  tensors and plain containers only, so even a data file replaced after its check
  can at worst change numbers, never run code.

The key is derived from the deployment's launch key (``stages/keys.py``) with a
label of its own: every node that trains already holds that file (nothing new to
distribute), tenants never can, and a seal is never a valid launch ticket or the
reverse. Rotating the launch key makes older checkpoints untrusted (by design).

Torch-free: the API lists checkpoints without importing torch.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

from pydantic import Field, ValidationError

from stages.base import StrictModel
from stages.errors import ErrorCode, ItoError
from stages.keys import read_launch_key

SEAL_NAME = "ito_seal.json"
# Written after the seal and read only as JSON by pydantic: outside the seal.
UNSEALED = frozenset({SEAL_NAME, "ito_commit.json", "ito_phase.json", ".ito_phase.json.tmp"})
_KEY_LABEL = b"ito checkpoint seal v1"
_CHUNK = 8 << 20
# A checkpoint is a few files per rank; a folder with more is not one of ours.
MAX_FILES = 100_000
MAX_SEAL_BYTES = 64 << 20
# .metadata is held in memory to be unpickled from the checked bytes.
MAX_METADATA_BYTES = 1 << 30
METADATA_NAME = ".metadata"


class FileDigest(StrictModel):
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Seal(StrictModel):
    version: int = Field(default=1, ge=1, le=1)
    files: dict[str, FileDigest]
    mac: str = Field(pattern=r"^[0-9a-f]{64}$")


def seal_key() -> bytes:
    """The deployment's checkpoint key (raises ``checkpoint_untrusted`` without one)."""
    return hmac.new(
        read_launch_key(ErrorCode.checkpoint_untrusted), _KEY_LABEL, hashlib.sha256
    ).digest()


def _mac(key: bytes, files: dict[str, FileDigest]) -> str:
    body = json.dumps(
        {k: [v.bytes, v.sha256] for k, v in sorted(files.items())}, separators=(",", ":")
    )
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _untrusted(folder: Path, why: str) -> ItoError:
    return ItoError(
        ErrorCode.checkpoint_untrusted,
        f"checkpoint {folder.name} was not written by this backend ({why}); "
        "nothing of it was loaded",
    )


def _open_dir(folder: Path) -> int:
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _untrusted(
            folder, "not a folder" if e.errno in (errno.ENOTDIR, errno.ELOOP) else "unreadable"
        ) from None


def _entries(folder: Path, dir_fd: int) -> list[str]:
    """The folder's files; anything else in it (a symlink, a subfolder) is refused."""
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            if not entry.is_file(follow_symlinks=False):
                raise _untrusted(folder, "it holds something other than plain files")
            names.append(entry.name)
            if len(names) > MAX_FILES:
                raise _untrusted(folder, "too many files")
    return names


def _digest(dir_fd: int, name: str, keep: bool = False) -> tuple[FileDigest, bytes]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        h, size, kept = hashlib.sha256(), 0, bytearray()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
            if keep:
                if size > MAX_METADATA_BYTES:
                    raise OSError(errno.EFBIG, "metadata too large")
                kept += chunk
    return FileDigest(bytes=size, sha256=h.hexdigest()), bytes(kept)


def write_seal(folder: Path, key: bytes, metadata_sha256: str | None) -> Seal:
    """Seal every file now in ``folder`` (call after DCP finished, before commit).
    ``metadata_sha256`` is the digest of the metadata DCP pickled: a ``.metadata``
    swapped in the folder since then is refused, never sealed."""
    dir_fd = _open_dir(folder)
    try:
        files = {
            n: _digest(dir_fd, n)[0] for n in sorted(_entries(folder, dir_fd)) if n not in UNSEALED
        }
    finally:
        os.close(dir_fd)
    written = files.get(METADATA_NAME)
    if written is None or written.sha256 != metadata_sha256:
        raise _untrusted(folder, "its metadata changed after DCP wrote it")
    seal = Seal(files=files, mac=_mac(key, files))
    path = folder / SEAL_NAME
    with path.open("w") as f:
        f.write(seal.model_dump_json())
        f.flush()
        os.fsync(f.fileno())
    return seal


def verify_seal(folder: Path, key: bytes) -> bytes:
    """Check ``folder`` against its seal; the checked bytes of its ``.metadata``.

    Raises ``checkpoint_untrusted`` on a missing or forged seal, a file missing,
    added, replaced by a symlink or changed, before anything is unpickled."""
    dir_fd = _open_dir(folder)
    try:
        try:
            raw = _read_small(dir_fd, SEAL_NAME)
            seal = Seal.model_validate_json(raw)
        except (OSError, ValidationError):
            raise _untrusted(folder, "no valid seal") from None
        if not hmac.compare_digest(_mac(key, seal.files), seal.mac):
            raise _untrusted(folder, "the seal does not verify")
        names = {n for n in _entries(folder, dir_fd) if n not in UNSEALED}
        if names != set(seal.files) or METADATA_NAME not in names:
            raise _untrusted(folder, "its files differ from the sealed ones")
        metadata = b""
        for name in sorted(names):
            try:
                got, kept = _digest(dir_fd, name, keep=name == METADATA_NAME)
            except OSError:
                raise _untrusted(folder, "a sealed file is unreadable") from None
            if got != seal.files[name]:
                raise _untrusted(folder, "a file changed after it was sealed")
            if name == METADATA_NAME:
                metadata = kept
        return metadata
    finally:
        os.close(dir_fd)


def _read_small(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        raw = f.read(MAX_SEAL_BYTES + 1)
    if len(raw) > MAX_SEAL_BYTES:
        raise OSError(errno.EFBIG, "seal too large")
    return raw
