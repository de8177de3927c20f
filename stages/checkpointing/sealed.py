"""Reading a DCP checkpoint this backend sealed: the one way one is read.

The seal is checked once, before anything is unpickled (``checkpoint_untrusted``
when it does not hold); ``.metadata`` is then unpickled from the bytes the check
hashed, non-tensor items with ``weights_only=True``. ``SealedCheckpoint`` reads the
tensors in parts (an HF export streams a large model through it a shard at a time);
``load_sealed`` reads a whole state dict.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

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


class _SealedReader(FileSystemReader):
    """Unpickles ``.metadata`` from the bytes the seal check read, never from a
    second read of the file (which could have been swapped since)."""

    def __init__(self, path: Path, metadata: bytes):
        super().__init__(path)
        self._metadata = metadata

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


class SealedCheckpoint:
    """A sealed checkpoint folder, its seal checked once at construction."""

    def __init__(self, path: Path, seal_key: bytes):
        self.path = path
        self._metadata = seal.verify_seal(path, seal_key)

    def tensors(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Every tensor's flattened name (``train.model.<param>``), global size and dtype."""
        md = _SealedReader(self.path, self._metadata).read_metadata()
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
            dcp.load(
                state_dict,
                storage_reader=_SealedReader(self.path, self._metadata),
                planner=_TensorsOnlyPlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
        except ItoError:
            raise
        except (Exception, CheckpointException) as e:
            raise ItoError(
                ErrorCode.checkpoint_corrupt,
                f"checkpoint {self.path.name} could not be loaded: {describe_failure(e)}",
            ) from e


def load_sealed(
    state_dict: dict[str, Any],
    path: Path,
    seal_key: bytes,
    *,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = True,
) -> None:
    """``dcp.load`` of a whole state dict from a sealed checkpoint, in place."""
    SealedCheckpoint(path, seal_key).load(state_dict, process_group=process_group, no_dist=no_dist)
