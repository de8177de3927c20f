"""The one symlink-safe path walk: ``openat`` component by component with ``O_NOFOLLOW``.

Used by the client's manifest and credentials readers, the server's submit-time
checks of data and checkpoint references, and the data-prep stage at run time (it
lives in ``stages`` because stages never import the orchestrator).

* a path is absolute and canonical: no ``.``, ``..``, ``//``, trailing ``/`` or NUL;
* every directory is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to its
  parent's descriptor, so a symlink anywhere on the path (or one swapped in
  mid-walk) is refused, never followed;
* the last component is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO must not
  block) and judged on its descriptor (``fstat``).

Failures are ``WalkError`` with a ``kind``; each caller maps kinds to its own codes
and decides what its messages may say (the server's say nothing about paths).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

Kind = Literal[
    "not_absolute",
    "not_canonical",
    "symlink",
    "not_dir",
    "not_regular",
    "missing",
    "outside",
    "unreadable",
]


class WalkError(Exception):
    def __init__(self, kind: Kind, name: str = "", last: bool = False, err: int = 0):
        super().__init__(kind)
        self.kind: Kind = kind
        self.name = name  # the offending component (callers decide whether to show it)
        self.last = last
        self.errno = err


def path_parts(path: str) -> list[str]:
    """Components of an absolute canonical path (without the root), or ``WalkError``."""
    if not isinstance(path, str) or not path:
        raise WalkError("not_absolute")
    if "\x00" in path:
        raise WalkError("not_canonical")
    if not path.startswith("/"):
        raise WalkError("not_absolute")
    parts = path[1:].split("/")
    if path == "/" or any(p in ("", ".", "..") for p in parts):
        raise WalkError("not_canonical")
    return parts


def _classify(exc: OSError, name: str, dir_fd: int, *, last: bool) -> WalkError:
    try:
        st: os.stat_result | None = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        st = None
    if (st is not None and stat.S_ISLNK(st.st_mode)) or exc.errno == errno.ELOOP:
        return WalkError("symlink", name, last, exc.errno or 0)
    if st is not None and not last and not stat.S_ISDIR(st.st_mode):
        return WalkError("not_dir", name, last, exc.errno or 0)
    if st is not None and last and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return WalkError("not_regular", name, last, exc.errno or 0)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return WalkError("missing", name, last, exc.errno)
    return WalkError("unreadable", name, last, exc.errno or 0)


def open_dir(path: str, *, follow: bool = False) -> int:
    """Open a directory: without ``follow`` by the safe walk from ``/``; with it (for an
    operator-configured root only) by an ordinary ``open``."""
    if follow:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise WalkError(
                "missing" if exc.errno == errno.ENOENT else "unreadable", err=exc.errno or 0
            ) from None
    fd, _ = walk(os.open("/", DIR_FLAGS), path_parts(path), want="dir")
    assert fd is not None
    return fd


def walk(
    start_fd: int,
    parts: Sequence[str],
    *,
    want: Literal["file", "dir", "any"] = "file",
    allow_missing: bool = False,
) -> tuple[int | None, os.stat_result | None]:
    """Walk ``parts`` below ``start_fd`` (which this call closes). Returns the last
    component's descriptor and stat; with ``allow_missing``, ``(None, None)`` when a
    component does not exist (everything that does exist was still walked safely)."""
    dir_fd = start_fd
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            flags = DIR_FLAGS if not last or want == "dir" else FILE_FLAGS
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except OSError as exc:
                err = _classify(exc, name, dir_fd, last=last)
                if err.kind == "missing" and allow_missing:
                    return None, None
                raise err from None
            os.close(dir_fd)
            dir_fd = fd
        st = os.fstat(dir_fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise WalkError("not_regular", parts[-1] if parts else "", True)
        if want == "file" and not stat.S_ISREG(st.st_mode):
            raise WalkError("not_regular", parts[-1] if parts else "", True)
        fd_out, dir_fd = dir_fd, -1
        return fd_out, st
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)


@dataclass(frozen=True)
class Inside:
    """A path found inside one of the roots: which root, and the parts below it."""

    root: str
    parts: tuple[str, ...]


def locate(path: str, roots: Sequence[str]) -> Inside:
    """The root that lexically contains the canonical ``path``; ``outside`` if none."""
    parts = path_parts(path)
    for root in roots:
        rparts = path_parts(root) if root != "/" else []
        if parts[: len(rparts)] == rparts:
            return Inside(root, tuple(parts[len(rparts) :]))
    raise WalkError("outside")


def open_inside(
    path: str,
    roots: Sequence[str],
    *,
    want: Literal["file", "dir", "any"] = "any",
    allow_missing: bool = False,
) -> tuple[int | None, os.stat_result | None]:
    """Open ``path`` only if it lies inside one of ``roots`` with no symlink below the
    root. The root itself is the operator's and is opened normally."""
    where = locate(path, roots)
    root_fd = open_dir(where.root, follow=True)
    if not where.parts:
        if want == "file":
            os.close(root_fd)
            raise WalkError("not_regular", last=True)
        return root_fd, os.fstat(root_fd)
    return walk(root_fd, where.parts, want=want, allow_missing=allow_missing)


def iter_tree(dir_fd: int, prefix: str = "") -> Iterator[tuple[str, int]]:
    """Every regular file below an open directory as ``(relative path, open fd)``,
    sorted by name; subfolders are entered with ``O_NOFOLLOW``; a symlink or special
    file anywhere below is refused (``WalkError``). The caller closes each file fd."""
    with os.scandir(dir_fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        rel = f"{prefix}{entry.name}"
        if entry.is_symlink():
            raise WalkError("symlink", entry.name)
        if entry.is_dir(follow_symlinks=False):
            try:
                sub = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                raise _classify(exc, entry.name, dir_fd, last=False) from None
            try:
                yield from iter_tree(sub, rel + "/")
            finally:
                os.close(sub)
        elif entry.is_file(follow_symlinks=False):
            try:
                fd = os.open(entry.name, FILE_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                raise _classify(exc, entry.name, dir_fd, last=True) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise WalkError("not_regular", entry.name, True)
            yield rel, fd
        else:
            raise WalkError("not_regular", entry.name, True)


def check_tree(dir_fd: int, max_entries: int = 100_000) -> int:
    """Refuse (``WalkError``) a symlink or special file anywhere below an open folder,
    without opening its files (the submit-time check; the run walks again with
    ``iter_tree``). Returns the number of entries seen; more than ``max_entries`` is
    ``unreadable`` (a bounded check)."""
    seen = 0
    stack = [os.dup(dir_fd)]
    try:
        while stack:
            fd = stack.pop()
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        seen += 1
                        if seen > max_entries:
                            raise WalkError("unreadable", entry.name)
                        if entry.is_symlink():
                            raise WalkError("symlink", entry.name)
                        if entry.is_dir(follow_symlinks=False):
                            try:
                                stack.append(os.open(entry.name, DIR_FLAGS, dir_fd=fd))
                            except OSError as exc:
                                raise _classify(exc, entry.name, fd, last=False) from None
                        elif not entry.is_file(follow_symlinks=False):
                            raise WalkError("not_regular", entry.name, True)
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return seen


def make_dirs(path: str, mode: int = 0o755) -> int:
    """Open the folder ``path``, creating what is missing of it, by the safe walk from
    ``/``: a symlink anywhere on the path (or one swapped in mid-walk) is refused
    (``WalkError``), never followed or created through."""
    dir_fd = os.open("/", DIR_FLAGS)
    try:
        for name in path_parts(path):
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                # Made meanwhile by another writer: opened (and judged) right below.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=dir_fd)
                try:
                    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                except OSError as exc:
                    raise _classify(exc, name, dir_fd, last=False) from None
            except OSError as exc:
                raise _classify(exc, name, dir_fd, last=False) from None
            os.close(dir_fd)
            dir_fd = fd
        fd_out, dir_fd = dir_fd, -1
        return fd_out
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
