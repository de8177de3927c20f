"""Tenant inputs read once, from the descriptors the safe walk opened.

A run reads a tenant's model folder, tokenizer, data refs and post-training datasets
through ``read_inside``: every file is opened by ``stages/safepath.py`` inside the
account's roots (a symlink anywhere on the path or below a folder is refused) and its
bytes are hashed as they are read. ``snapshot`` copies those bytes into the run's own
scratch space and the stage loads the copy; a parser that needs no folder (the
post-training datasets) parses the bytes it hashed. Either way a swap inside the
tenant's root after the check (a symlink, another file) changes nothing the run reads,
and a digest compared is the digest of what is trained on.

Digests follow ``DataRef``'s rule: a file's sha256, or for a folder the sha256 of the
sorted lines ``"<relative path>\\t<file sha256>\\n"`` of the files counted (data files
for a data ref, every file for a model folder).

Refusals say nothing about paths outside the roots: a path that leaves them is
``path_outside_root`` whether or not its target exists (``stages.pathfields.outside``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stages import safepath
from stages.errors import ErrorCode, ItoError
from stages.pathfields import RootKind, outside

_CHUNK = 1 << 20
_COPY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def tree_digest(files: Iterable[tuple[str, str]]) -> str:
    """The folder rule over ``(relative path, sha256)`` pairs."""
    lines = sorted(f"{rel}\t{sha}\n" for rel, sha in files)
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class InputFile:
    relpath: str  # below the folder, or the file's name
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Snapshot:
    path: Path | None  # the private copy (None when only hashed)
    is_dir: bool
    files: tuple[InputFile, ...]

    @property
    def sha256(self) -> str:
        if not self.is_dir:
            return self.files[0].sha256
        return tree_digest((f.relpath, f.sha256) for f in self.files)


def read_inside(
    path: str,
    roots: Sequence[str],
    where: str,
    *,
    kind: RootKind = "data",
    want: Literal["file", "dir", "any"] = "any",
    include: Callable[[str], bool] | None = None,
    missing: ErrorCode = ErrorCode.data_not_found,
) -> Iterator[tuple[str, int, bool]]:
    """``(relative path, open fd, is_dir)`` of the file at ``path`` or of every file
    below the folder (sorted, ``include`` filtering by relative path), all opened by the
    safe walk inside ``roots``. The caller reads each fd; this closes it."""
    try:
        fd, st = safepath.open_inside(path, roots, want=want)
    except safepath.WalkError as e:
        if e.kind == "missing":
            raise ItoError(missing, f"{where}: no such file or folder") from None
        raise outside(where, kind) from None
    except OSError:
        raise outside(where, kind) from None
    assert fd is not None and st is not None
    try:
        if not stat.S_ISDIR(st.st_mode):
            yield path.rsplit("/", 1)[-1], fd, False
            return
        try:
            for rel, ffd in safepath.iter_tree(fd):
                try:
                    if include is None or include(rel):
                        yield rel, ffd, True
                finally:
                    os.close(ffd)
        except (safepath.WalkError, OSError):
            raise outside(where, kind) from None
    finally:
        os.close(fd)


def hash_fd(fd: int) -> tuple[str, int]:
    """sha256 and size of what is left to read from ``fd``."""
    f = _copy(fd, None)
    return f.sha256, f.bytes


def _copy(fd: int, dest: Path | None) -> InputFile:
    h, n = hashlib.sha256(), 0
    out = os.open(dest, _COPY_FLAGS, 0o600) if dest is not None else -1
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            n += len(chunk)
            if out >= 0:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        if out >= 0:
            os.fsync(out)
    finally:
        if out >= 0:
            os.close(out)
    return InputFile("", h.hexdigest(), n)


def snapshot(
    path: str,
    roots: Sequence[str],
    dest: Path | None,
    where: str,
    *,
    kind: RootKind = "data",
    want: Literal["file", "dir", "any"] = "any",
    include: Callable[[str], bool] | None = None,
    missing: ErrorCode = ErrorCode.data_not_found,
) -> Snapshot:
    """Copy into the folder ``dest`` (created; an earlier attempt's is replaced) and
    hash the input at ``path``: a file lands as ``dest/<name>``, a folder's files below
    ``dest``. ``dest=None`` only hashes. An empty folder gives no files (the caller
    says what that means)."""
    if dest is not None:
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        dest.mkdir(parents=True)
    files: list[InputFile] = []
    is_dir, copy = True, dest
    for rel, fd, is_dir in read_inside(
        path, roots, where, kind=kind, want=want, include=include, missing=missing
    ):
        target = None
        if dest is not None:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            copy = dest if is_dir else target
        f = _copy(fd, target)
        files.append(InputFile(rel, f.sha256, f.bytes))
    return Snapshot(copy, is_dir, tuple(files))


def path_digest(path: str | Path, include: Callable[[str], bool] | None = None) -> str:
    """The digest of a file or folder by the rule above (for tenants and tests writing
    a manifest: e.g. ``post_training.base_model_sha256``)."""
    return snapshot(str(path), ("/",), None, "path", include=include).sha256
