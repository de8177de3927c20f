"""The one atomic file write: a reader sees the old file or the whole new one, never part.

A write goes to a fresh temp file beside the target (``.<name>.<random>.tmp``, created
``O_EXCL | O_NOFOLLOW``, so two writers never share one and nothing planted under the
name is written through), is flushed, and is renamed over the target (``os.replace``:
atomic on POSIX within one filesystem; a symlink at the target is replaced, never
followed). Any failure, the caller's own included, removes the temp and re-raises; a
process killed mid-write leaves only a hidden temp, never a partial target.

``durable=True`` (the default) fsyncs the file before the rename and the folder after
it, so the new file survives a power loss once the call returns. Files that are
rebuilt from their inputs after a crash anyway may pass ``durable=False``.

``exclusive=True`` publishes with ``os.link`` instead of the rename: the call fails
with ``FileExistsError`` if anything (a file, a symlink) already has the name, and
never replaces it.

Writes that publish a whole folder (a checkpoint, an export) or that name files
relative to a directory descriptor keep their own code and use ``fsync_dir`` here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal, overload

_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync the folder ``path``: a rename or create inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@overload
def open_atomic(
    path: str | os.PathLike[str],
    mode: Literal["wb"] = ...,
    *,
    durable: bool = ...,
    perms: int | None = ...,
    exclusive: bool = ...,
) -> contextlib.AbstractContextManager[IO[bytes]]: ...


@overload
def open_atomic(
    path: str | os.PathLike[str],
    mode: Literal["w"],
    *,
    durable: bool = ...,
    perms: int | None = ...,
    exclusive: bool = ...,
) -> contextlib.AbstractContextManager[IO[str]]: ...


def open_atomic(
    path: str | os.PathLike[str],
    mode: Literal["wb", "w"] = "wb",
    *,
    durable: bool = True,
    perms: int | None = None,
    exclusive: bool = False,
) -> contextlib.AbstractContextManager[IO[Any]]:
    """A file to write ``path``'s new content into (``"w"``: UTF-8 text); it replaces
    ``path`` when the ``with`` block ends without an exception.

    ``perms``: the file's permission bits, exactly (``None``: ``0o666`` less the umask,
    as ``open`` creates files). The folder must exist."""
    if mode not in ("wb", "w"):
        raise ValueError(f"open_atomic: mode {mode!r} (wb or w)")
    return _open_atomic(Path(path), mode, durable, perms, exclusive)


@contextlib.contextmanager
def _open_atomic(
    path: Path, mode: str, durable: bool, perms: int | None, exclusive: bool
) -> Iterator[IO[Any]]:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, _TEMP_FLAGS, 0o666 if perms is None else perms)
    try:
        if perms is not None:
            os.fchmod(fd, perms)  # the umask may have taken bits away
        f = os.fdopen(fd, mode, encoding="utf-8" if mode == "w" else None)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # EEXIST when the name is taken: nothing is replaced
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_bytes(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    durable: bool = True,
    perms: int | None = None,
    exclusive: bool = False,
) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring)."""
    with open_atomic(path, "wb", durable=durable, perms=perms, exclusive=exclusive) as f:
        f.write(data)


def write_text(
    path: str | os.PathLike[str],
    text: str,
    *,
    durable: bool = True,
    perms: int | None = None,
    exclusive: bool = False,
) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically (see the module docstring)."""
    with open_atomic(path, "w", durable=durable, perms=perms, exclusive=exclusive) as f:
        f.write(text)
