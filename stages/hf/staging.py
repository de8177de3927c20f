"""An export's staging folder, which lies in the tenant-writable checkpoint root.

The folder is reached and created by the safe walk (``stages/safepath.py``: every
component opened with ``O_NOFOLLOW`` relative to its parent), then held open: every
file is created by name relative to its descriptor with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` and renamed into place within it, and the folder is renamed and removed
by name relative to its parent's descriptor. A symlink planted on the export's path,
in place of the folder or of a file in it, is refused or replaced, never followed:
nothing is written outside the folder the walk opened. Writers that take a path
(``save_pretrained``) write into a private temp folder first; safetensors writes
through the held folder's own descriptor path (``/proc/self/fd``), never through a
path the tenant can change.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from stages import safepath
from stages.errors import ErrorCode, ItoError

if TYPE_CHECKING:
    import torch

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


def _unsafe(path: Path, kind: str) -> ItoError:
    return ItoError(
        ErrorCode.checkpoint_storage_unwritable,
        f"export staging folder {path.name}: refused ({kind} on its path); nothing was "
        "written through it",
    )


class Staging:
    """The staging folder ``path``, opened by the safe walk (created when missing;
    ``fresh``: whatever was there is removed first)."""

    def __init__(self, path: Path, *, fresh: bool = False) -> None:
        self.path = path
        try:
            self._parent = safepath.make_dirs(str(path.parent))
        except safepath.WalkError as e:
            raise _unsafe(path, e.kind) from None
        try:
            if fresh:
                self._remove_entry(path.name)
            # Another rank's share may have made it: opened (and judged) below.
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.name, 0o755, dir_fd=self._parent)
            try:
                self.fd = os.open(path.name, safepath.DIR_FLAGS, dir_fd=self._parent)
            except OSError:
                raise _unsafe(path, "a symlink or a file") from None
        except BaseException:
            os.close(self._parent)
            raise

    def _remove_entry(self, name: str) -> None:
        """Remove ``name`` from the parent: a folder's tree without following anything
        in it, anything else (a symlink included) by unlinking the name itself."""
        try:
            st = os.stat(name, dir_fd=self._parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self._parent)
        else:
            os.unlink(name, dir_fd=self._parent)

    def write(self, name: str, fill: Callable[[BinaryIO], object]) -> None:
        """Create ``name`` in the folder: ``fill`` writes a new private file (made with
        ``O_EXCL | O_NOFOLLOW`` under a random name), which is then renamed to ``name``
        (whatever held that name, a symlink included, is replaced, never written
        through)."""
        part = f".{name}.{secrets.token_hex(8)}"
        fd = os.open(part, _NEW_FILE, 0o644, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
        except BaseException:
            self._remove_file(part)
            raise
        os.replace(part, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """A safetensors file ``name``: ``save_file`` writes a temp file and renames it
        (neither follows a symlink), inside the folder this object holds open (its
        ``/proc/self/fd`` path, which no rename or symlink on the way can redirect);
        then it is renamed to ``name``."""
        from safetensors.torch import save_file

        part = f".{name}.{secrets.token_hex(8)}"
        save_file(tensors, f"/proc/self/fd/{self.fd}/{part}", metadata={"format": "pt"})
        st = os.stat(part, dir_fd=self.fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            self._remove_file(part)
            raise _unsafe(self.path, "a file swapped in")
        os.replace(part, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write(name, lambda f: f.write(data))

    def copy_in(self, private: Path) -> None:
        """Every file of a private folder (``save_pretrained``'s output) into this one."""
        for src in sorted(private.iterdir()):
            if not src.is_file() or src.is_symlink():
                continue

            def fill(f: BinaryIO, src: Path = src) -> None:
                with src.open("rb") as i:
                    shutil.copyfileobj(i, f, _CHUNK)

            self.write(src.name, fill)

    def discard(self, name: str) -> None:
        """Remove ``name`` from the folder (a symlink itself, never its target)."""
        self._remove_file(name)

    def _remove_file(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(name, dir_fd=self.fd)

    def has_file(self, name: str) -> bool:
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode)

    def sha256s(self) -> dict[str, str]:
        """Each file's sha256 (the safe walk: a symlink or subfolder in it is refused)."""
        out: dict[str, str] = {}
        try:
            for rel, fd in safepath.iter_tree(self.fd):
                with os.fdopen(fd, "rb") as f:
                    h = hashlib.sha256()
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                out[rel] = h.hexdigest()
        except safepath.WalkError as e:
            raise _unsafe(self.path, e.kind) from None
        return out

    def publish(self, out_dir: Path) -> None:
        """Rename the folder to ``out_dir`` (beside it), replacing what was there."""
        if out_dir.parent != self.path.parent:
            raise ItoError(ErrorCode.invalid_state, "an export is renamed beside its staging")
        self._remove_entry(out_dir.name)
        os.replace(self.path.name, out_dir.name, src_dir_fd=self._parent, dst_dir_fd=self._parent)

    def remove(self) -> None:
        """Remove the folder (on a failed export)."""
        with contextlib.suppress(OSError):
            self._remove_entry(self.path.name)

    def close(self) -> None:
        for fd in (self.fd, self._parent):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
