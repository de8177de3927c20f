"""Reading a DCP checkpoint this backend sealed: the one way one is read.

``SealedCheckpoint`` checks the seal, what it is bound to (``checkpoint_foreign``
for another run's, account's, step's or phase's), the folder's listing and
``.metadata`` once, before anything is unpickled (``checkpoint_untrusted`` when they
do not hold); ``.metadata`` is then unpickled from the bytes the check hashed, never
from a second read of the file. A data file is checked when DCP first opens it, on
the very descriptor DCP then reads (so a rank hashes only the files it reads, once
per ``SealedCheckpoint``); non-tensor items are unpickled with ``weights_only=True``.
It reads the tensors in parts (an HF export streams a large model through it a shard
at a time); ``load_sealed`` reads a whole state dict.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from stages.checkpointing import seal
from stages.errors import ErrorCode, ItoError


def describe_failure(e: BaseException) -> str:
    """A short, path-free reason for a failed save or load (no tracebacks)."""
    if isinstance(e, CheckpointException):
        inner = [exc for exc, _trace in e.failures.values()]
        return "; ".join(
            f"rank {r}: {describe_failure(x)}" for r, x in zip(e.failures, inner, strict=True)
        )
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {e.strerror}"
    return f"{type(e).__name__}: {e}"


class _CheckingFileSystem(FileSystem):
    """Opens the checkpoint's data files for DCP's reader by name inside the folder
    (never through a symlink) and checks each against the seal on its first opening,
    on the descriptor DCP then reads."""

    def __init__(self, checkpoint: SealedCheckpoint) -> None:
        super().__init__()
        self._ckpt = checkpoint

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise ItoError(ErrorCode.invalid_state, "a sealed checkpoint is read only")
        with os.fdopen(self._ckpt.open_checked(Path(path)), "rb") as stream:
            yield stream


class _SealedReader(FileSystemReader):
    """Unpickles ``.metadata`` from the bytes the seal check read, never from a
    second read of the file (which could have been swapped since); data files are
    opened through ``_CheckingFileSystem``."""

    def __init__(self, checkpoint: SealedCheckpoint):
        super().__init__(checkpoint.path)
        self.fs = _CheckingFileSystem(checkpoint)
        self._metadata = checkpoint.metadata_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = pickle.loads(self._metadata)  # the bytes the seal check hashed
        if not isinstance(metadata, Metadata):
            raise ItoError(ErrorCode.checkpoint_corrupt, "DCP metadata has the wrong type")
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


# numpy arrays of numbers (the RNG state of a TrainState), rebuilt from their buffers:
# data only (no object dtype).
_SAFE_GLOBALS: list[Any] = [
    np._core.multiarray._reconstruct,  # type: ignore[attr-defined]
    np.ndarray,
    np.dtype,
    *(type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFD"),
]


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor items are unpickled with
    ``weights_only=True`` (tensors, numpy arrays and plain containers only: no code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            item = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
        else:
            self.state_dict[read_item.dest_index.fqn] = item


_STEP_FOLDER = re.compile(r"^step_(\d{9,})$")


class SealedCheckpoint:
    """A sealed checkpoint folder of ``run``: its seal, binding, listing and metadata
    checked at construction (``phase``: it must also have been saved in that phase);
    its data files as they are read."""

    def __init__(
        self,
        path: Path,
        seal_key: bytes,
        run: seal.CheckpointBinding,
        *,
        phase: str | None = None,
    ):
        self.path = path
        dir_fd = seal.open_dir(path)
        try:
            self._seal = seal.read_seal(path, dir_fd, seal_key)
            named = _STEP_FOLDER.match(path.name)
            seal.check_binding(
                path,
                self._seal,
                run,
                step=int(named.group(1)) if named else None,
                phase=phase,
            )
            seal.check_listing(path, dir_fd, self._seal)
            self.metadata_bytes = seal.read_checked(
                path, dir_fd, self._seal, seal.METADATA_NAME, seal.MAX_METADATA_BYTES
            )
            # The commit record is what listings show: sealed, and of the sealed step.
            record = seal.read_checked(
                path, dir_fd, self._seal, seal.COMMIT_NAME, seal.MAX_RECORD_BYTES
            )
            seal.check_record_step(path, self._seal, record)
        finally:
            os.close(dir_fd)
        self._checked: set[str] = {seal.METADATA_NAME}
        self._lock = threading.Lock()

    @property
    def binding(self) -> seal.SealBinding:
        return self._seal.binding

    def open_checked(self, path: Path) -> int:
        """A sealed file of this checkpoint, opened by name inside the folder, checked
        against the seal the first time (``checkpoint_untrusted``)."""
        name = path.name
        if path.parent != self.path or name not in self._seal.files:
            raise seal.untrusted(self.path, "its metadata names a file it was not sealed with")
        dir_fd = seal.open_dir(self.path)
        try:
            fd = seal.open_file(dir_fd, name)
        except OSError:
            raise seal.untrusted(self.path, "a sealed file is unreadable") from None
        finally:
            os.close(dir_fd)
        try:
            with self._lock:
                if name not in self._checked:
                    seal.check_open_file(self.path, fd, self._seal, name)
                    self._checked.add(name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def tensors(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Every tensor's flattened name (``train.model.<param>``), global size and dtype."""
        md = _SealedReader(self).read_metadata()
        return {
            fqn: (m.size, m.properties.dtype)
            for fqn, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }

    def load(
        self,
        state_dict: dict[str, Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        no_dist: bool = True,
    ) -> None:
        """``dcp.load`` into ``state_dict`` in place: only the entries it names are read
        (``checkpoint_corrupt`` when DCP fails)."""
        try:
            dcp_load(
                state_dict,
                storage_reader=_SealedReader(self),
                planner=_TensorsOnlyPlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
        except ItoError:
            raise
        except (Exception, CheckpointException) as e:
            # A file that failed its check while DCP read it: that refusal, as it is.
            failures = e.failures.values() if isinstance(e, CheckpointException) else ()
            refused = [x for x, _trace in failures if isinstance(x, ItoError)]
            if refused:
                raise refused[0] from e
            raise ItoError(
                ErrorCode.checkpoint_corrupt,
                f"checkpoint {self.path.name} could not be loaded: {describe_failure(e)}",
            ) from e


def load_sealed(
    state_dict: dict[str, Any],
    path: Path,
    seal_key: bytes,
    run: seal.CheckpointBinding,
    *,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = True,
) -> None:
    """``dcp.load`` of a whole state dict from a sealed checkpoint of ``run``, in place."""
    SealedCheckpoint(path, seal_key, run).load(
        state_dict, process_group=process_group, no_dist=no_dist
    )
