"""Read a training manifest from disk the way the contract demands, before any network call.

The manifest is what the approver confirmed (its digest is bound into the
confirmation), so the client must send exactly the bytes it vetted and must not be
tricked into reading something else:

* the path is absolute and canonical (no ``.``/``..``/``//``/trailing ``/``), so what
  the user typed is what gets opened;
* no component of the path is a symlink: we walk from ``/`` opening every directory
  with ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent's descriptor (``openat``),
  so a directory swapped for a symlink mid-walk is caught, not followed;
* the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO must not block us), and
  every property is checked on that descriptor (``fstat``): regular file, owned by
  the caller, not group/world-writable, at most ``MANIFEST_MAX_BYTES``;
* the sha256 digest is computed from the bytes read from that same descriptor.

Every refusal is an ``ItoError`` with its own ``manifest_*`` code; the CLI turns it
into an envelope with ``live_api_contacted: false``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from dataclasses import dataclass

from stages import safepath
from stages.errors import ErrorCode, ItoError
from stages.safepath import WalkError, path_parts

# A manifest is a small JSON document; anything bigger is a mistake or an attack.
MANIFEST_MAX_BYTES = 1 << 20
_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ManifestBytes:
    """The exact bytes of a vetted manifest and their sha256 (hex)."""

    path: str
    data: bytes
    digest: str

    @property
    def b64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

    @property
    def manifest_id(self) -> str:
        # Same derivation as the server (docs/api-contract.md).
        return "mf_" + self.digest[:24]


def _refuse(code: ErrorCode, path: str, why: str) -> ItoError:
    return ItoError(code, f"manifest {path!r} refused: {why}")


_WHY = {
    "not_absolute": (ErrorCode.manifest_path_not_absolute, "path must be absolute (start with /)"),
    "not_canonical": (
        ErrorCode.manifest_path_not_canonical,
        "path must be canonical (no '.', '..', '//', NUL or trailing '/')",
    ),
    "symlink": (ErrorCode.manifest_symlink, "a symlink is on the path"),
    "not_regular": (ErrorCode.manifest_not_regular_file, "not a regular file"),
}


def walk_refusal(exc: WalkError, path: str) -> ItoError:
    """The manifest_* refusal for a failed safe walk (the credentials reader reuses it)."""
    code, why = _WHY.get(exc.kind, (ErrorCode.manifest_unreadable, ""))
    if exc.kind == "symlink":
        why = "the file is a symlink" if exc.last else f"path component {exc.name!r} is a symlink"
    elif exc.kind == "not_dir":
        why = f"{exc.name!r} is not a directory"
    elif not why:
        why = os.strerror(exc.errno) if exc.errno else "cannot open"
    return _refuse(code, path, why)


def check_manifest_path(path: str) -> list[str]:
    """Validate the path's shape; returns its components (without the root)."""
    try:
        return path_parts(path)
    except WalkError as exc:
        raise walk_refusal(exc, str(path)) from None


def _open_no_follow(path: str, parts: list[str]) -> int:
    """Walk ``parts`` from ``/`` with openat + O_NOFOLLOW; return the file's descriptor."""
    try:
        fd, _ = safepath.walk(os.open("/", safepath.DIR_FLAGS), parts, want="any")
    except WalkError as exc:
        raise walk_refusal(exc, path) from None
    assert fd is not None
    return fd


def _check_descriptor(fd: int, path: str, *, euid: int, max_bytes: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "not a regular file"
        )
        raise _refuse(ErrorCode.manifest_not_regular_file, path, kind)
    if st.st_uid != euid:
        raise _refuse(
            ErrorCode.manifest_not_owned, path, f"owned by uid {st.st_uid}, not the caller ({euid})"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(
            ErrorCode.manifest_insecure_permissions,
            path,
            f"mode {stat.S_IMODE(st.st_mode):04o} is group- or world-writable",
        )
    if st.st_size > max_bytes:
        raise _refuse(ErrorCode.manifest_too_large, path, f"{st.st_size} bytes exceeds {max_bytes}")


def _read_bounded(fd: int, path: str, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except OSError as exc:
            raise _refuse(
                ErrorCode.manifest_unreadable, path, os.strerror(exc.errno or 0)
            ) from None
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        # The file may grow after fstat: the cap is enforced on what we actually read.
        if total > max_bytes:
            raise _refuse(ErrorCode.manifest_too_large, path, f"more than {max_bytes} bytes")
        chunks.append(chunk)


def read_manifest(
    path: str, *, max_bytes: int = MANIFEST_MAX_BYTES, euid: int | None = None
) -> ManifestBytes:
    """Open, vet and read the manifest at ``path``; raise ``ItoError`` on any refusal.

    ``euid`` defaults to the process's effective uid (the owner the file must have).
    """
    parts = check_manifest_path(path)
    owner = os.geteuid() if euid is None else euid
    fd = _open_no_follow(path, parts)
    try:
        _check_descriptor(fd, path, euid=owner, max_bytes=max_bytes)
        data = _read_bounded(fd, path, max_bytes)
    finally:
        os.close(fd)
    return ManifestBytes(path=path, data=data, digest=hashlib.sha256(data).hexdigest())
