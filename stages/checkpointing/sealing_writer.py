"""DCP's file writer, digesting every file it writes from the bytes it writes.

The seal (``seal.py``) must cover what DCP wrote, not whatever sits in the
(tenant-writable) temp folder by the time the seal is written, and it must not cost
a second pass over the checkpoint: every stream DCP writes (its data files and its
``.metadata``) goes through a ``_DigestingStream``, which hashes each write from the
caller's buffer (BLAKE3: ~0.4 s a GB on one core here) and writes it on; the file's
digest is ready when its stream is closed. Handing copies to a hashing thread was
slower on this 2-core host (1.8-3.8 s against 1.5-2.7 s for a 1 GB save, same
runs): a copy costs more than BLAKE3's hash of the same bytes.

DCP writes each tensor with ``torch.save``, whose zip records carry a CRC-32 that
torch computes byte by byte (the larger part of DCP's own write time here: 3.1-3.3 s
against 1.1-1.6 s for 1 GB) and that ``torch.load`` never checks; the seal's digests
are the checkpoint's integrity check, so the writer turns the CRC off while it writes
(``_zip_crc_off``; torch's setting is process-wide: another ``torch.save`` meanwhile
writes a zero CRC, which every torch reader accepts as it accepts any).

The ranks' digests reach the coordinator with DCP's own write results (one extra
result per file, taken out again before DCP builds its metadata), so the coordinator
seals files it never read.
"""

from __future__ import annotations

import ctypes
import io
import os
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from stages.checkpointing.seal import METADATA_NAME, FileDigest, file_hasher

# DCP pickles the metadata into this temporary file (``__<rank>`` prefixed when ranks
# write their own), then renames it to ``.metadata``.
_METADATA_TMP_SUFFIX = f"{METADATA_NAME}.tmp"
# How much a checkpoint file's writer writes between two starts of the disk's writeback.
WRITEBACK_BYTES = 32 << 20
# Marks the extra write result that carries a file's digest to the coordinator.
_DIGEST_FQN = "\x00ito-file-digest"


_crc_lock = threading.Lock()
_crc_writers = 0
_crc_before = True


@contextmanager
def _zip_crc_off() -> Generator[None, None, None]:
    """``torch.save`` without its zip CRC-32 while any checkpoint writer writes."""
    global _crc_writers, _crc_before
    with _crc_lock:
        if _crc_writers == 0:
            _crc_before = serialization_config.save.compute_crc32
            serialization_config.save.compute_crc32 = False
        _crc_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0:
                serialization_config.save.compute_crc32 = _crc_before


def _libc_sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux's ``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``: start the
    writeback of a range without waiting for it (None where there is none)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    write = 2  # SYNC_FILE_RANGE_WRITE

    def start(fd: int, offset: int, n: int) -> None:
        fn(fd, offset, n, write)  # a hint: its failure only means a later fsync waits

    return start


_START_WRITEBACK = _libc_sync_file_range()


class _DigestingStream:
    """A write-through stream whose bytes are hashed as they go through it (DCP and
    pickle only write, tell, flush and fsync through it). Every ``WRITEBACK_BYTES`` it
    starts the disk's writeback of what it wrote (``sync_file_range``), so the disk
    works while the next tensors are serialized and hashed, instead of all of it in
    DCP's final fsync (Linux starts writeback on its own only past
    ``dirty_background_ratio``, 10% of memory)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._hasher = file_hasher()
        self._bytes = 0
        self._flushed = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)  # from the caller's buffer: no copy
        self._bytes += len(view)
        n = int(self._stream.write(data))
        if _START_WRITEBACK is not None and self._bytes - self._flushed >= WRITEBACK_BYTES:
            self._stream.flush()
            _START_WRITEBACK(self._stream.fileno(), self._flushed, self._bytes - self._flushed)
            self._flushed = self._bytes
        return n

    def digest(self) -> FileDigest:
        """The digest of everything written."""
        return FileDigest(bytes=self._bytes, blake3=self._hasher.hexdigest())

    def __getattr__(self, name: str) -> Any:  # fileno for fsync, flush, tell, ...
        return getattr(self._stream, name)


class _DigestingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.digests: dict[str, FileDigest] = {}

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        if name.endswith(_METADATA_TMP_SUFFIX):
            name = name.removesuffix(".tmp")  # renamed into place by DCP
        with super().create_stream(path, mode) as stream:
            digesting = _DigestingStream(stream)
            try:
                yield digesting  # type: ignore[misc]  # duck-typed: DCP only writes
            finally:
                digest = digesting.digest()
        with self._lock:
            self.digests[name] = digest


@dataclass(frozen=True)
class _Digest:
    name: str
    bytes: int
    blake3: str


class SealingWriter(FileSystemWriter):
    """``FileSystemWriter`` that knows the digest of every file of the checkpoint as
    it was written: ``file_digests`` on the coordinator once ``finish`` has run
    (the data files of every rank, and ``.metadata``)."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._digesting_fs = _DigestingFileSystem()
        self.fs = self._digesting_fs
        self._ranks_digests: dict[str, FileDigest] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with _zip_crc_off():
            results = super().write_data(plan, planner).wait()  # DCP's writer is synchronous
        with self._digesting_fs._lock:
            mine = dict(self._digesting_fs.digests)
        extra = [
            WriteResult(
                index=MetadataIndex(fqn=_DIGEST_FQN, index=i),
                size_in_bytes=d.bytes,
                storage_data=_Digest(name, d.bytes, d.blake3),
            )
            for i, (name, d) in enumerate(sorted(mine.items()))
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results + extra)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        kept: list[list[WriteResult]] = []
        for rank_results in results:
            kept.append([])
            for r in rank_results:
                if r.index.fqn == _DIGEST_FQN and isinstance(r.storage_data, _Digest):
                    d = r.storage_data
                    self._ranks_digests[d.name] = FileDigest(bytes=d.bytes, blake3=d.blake3)
                else:
                    kept[-1].append(r)
        super().finish(metadata, kept)

    @property
    def file_digests(self) -> dict[str, FileDigest]:
        """Every file of the checkpoint and its digest (the coordinator's, after
        ``finish``): what the seal may list, and nothing else."""
        with self._digesting_fs._lock:
            metadata = self._digesting_fs.digests.get(METADATA_NAME)
        out = dict(self._ranks_digests)
        if metadata is not None:
            out[METADATA_NAME] = metadata
        return out
