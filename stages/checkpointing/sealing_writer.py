"""DCP's file writer, remembering the digest of the metadata bytes it wrote.

The seal (``seal.py``) must cover DCP's own ``.metadata``, not whatever sits in the
(tenant-writable) folder by the time the seal is written. The digest is taken from
the bytes as they go through DCP's stream, not by pickling the ``Metadata`` object
again: DCP may write a copy of that object (torch 2.11 pickles a
``dataclasses.replace`` of it with the version set), so a re-pickle is not the file.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from stages.checkpointing.seal import METADATA_NAME

# DCP pickles the metadata into this temporary file (``__<rank>`` prefixed when ranks
# write their own), then renames it to ``.metadata``.
_METADATA_TMP_SUFFIX = f"{METADATA_NAME}.tmp"


class _HashingStream:
    """A write-through stream that hashes what is written (pickle.dump only writes)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return int(self._stream.write(data))

    def __getattr__(self, name: str) -> Any:  # fileno for fsync, flush, ...
        return getattr(self._stream, name)


class _MetadataHashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.metadata_sha256: str | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            if not Path(path).name.endswith(_METADATA_TMP_SUFFIX):
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing  # type: ignore[misc]  # duck-typed: DCP only writes and fsyncs
            self.metadata_sha256 = hashing.sha256.hexdigest()


class SealingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``metadata_sha256`` is the digest of the bytes of the
    ``.metadata`` it wrote (None until ``finish`` has written it)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._hashing_fs = _MetadataHashingFileSystem()
        self.fs = self._hashing_fs

    @property
    def metadata_sha256(self) -> str | None:
        return self._hashing_fs.metadata_sha256
