"""Input indexing: files -> blocks of documents, and reading one block.

The block index is built in one streaming pass over every input file (sha256 of its
bytes and, for jsonl/text, the byte offset of every ``block_docs``-th document);
nothing of the corpus stays in memory. A block is a byte range of a jsonl/text file or
a row range of a parquet file, with the global index of its first document; documents
are numbered in input order (sources in the order given, files by relative path, then
lines), the order whose lowest member survives a duplicate cluster.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from stages.data_prep.refs import DATA_SUFFIXES, data_files
from stages.errors import ErrorCode, ItoError


@dataclass(frozen=True)
class Source:
    """One input file."""

    path: str
    relpath: str
    format: str  # jsonl | parquet | text
    sha256: str
    bytes: int
    ref: int = 0  # index of the manifest ref (or 0 for the command line)
    role: str = "custom"
    text_field: str | None = None  # None: the block index's


@dataclass(frozen=True)
class Block:
    index: int
    source: int
    start: int  # byte offset (jsonl/text) or row (parquet)
    stop: int
    doc_start: int  # global index of the first document
    docs: int
    line_start: int  # index of the first document within its file (for provenance ids)


@dataclass
class BlockIndex:
    """The input's files and their blocks, in document order."""

    sources: list[Source]
    blocks: list[Block]
    text_field: str

    @property
    def docs(self) -> int:
        return sum(b.docs for b in self.blocks)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sources)

    def to_json(self) -> dict[str, Any]:
        return {
            "sources": [asdict(s) for s in self.sources],
            "blocks": [asdict(b) for b in self.blocks],
            "text_field": self.text_field,
        }

    def doc_id(self, index: int) -> str:
        """The provenance id "<ref>:<relpath>:<n>" of the document at a global index."""
        lo, hi = 0, len(self.blocks) - 1
        while lo < hi:  # the last block starting at or before ``index``
            mid = (lo + hi + 1) // 2
            if self.blocks[mid].doc_start <= index:
                lo = mid
            else:
                hi = mid - 1
        blk = self.blocks[lo]
        src = self.sources[blk.source]
        return f"{src.ref}:{src.relpath}:{blk.line_start + index - blk.doc_start}"

    def input_sha256(self, folder: bool) -> str:
        """The DataRef digest of the whole input: a single file's sha256, or the folder
        rule (sha256 of the sorted "<relpath>\t<sha256>\n" lines)."""
        if not folder and len(self.sources) == 1:
            return self.sources[0].sha256
        lines = sorted(f"{s.relpath}\t{s.sha256}\n" for s in self.sources)
        return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> BlockIndex:
        return cls(
            [Source(**s) for s in obj["sources"]],
            [Block(**b) for b in obj["blocks"]],
            obj["text_field"],
        )


def input_files(path: Path) -> list[tuple[Path, str, str]]:
    """(path, relpath, format) of a file or of every data file under a folder."""
    if not path.exists():
        raise ItoError(ErrorCode.data_not_found, f"no such file or folder: {path}")
    files = data_files(path) if path.is_dir() else [path]
    if not files:
        raise ItoError(ErrorCode.data_empty, f"no data files under {path}")
    return [
        (
            f,
            f.relative_to(path).as_posix() if path.is_dir() else f.name,
            DATA_SUFFIXES.get(f.suffix, "jsonl"),
        )
        for f in files
    ]


def _scan_lines(path: Path, block_docs: int) -> tuple[str, list[tuple[int, int, int, int]]]:
    """sha256 and (start, stop, docs, first line) ranges of ``block_docs`` non-blank
    lines each, in one pass."""
    h = hashlib.sha256()
    ranges: list[tuple[int, int, int, int]] = []
    offset = start = docs = seen = 0
    with open(path, "rb") as f:
        for line in f:
            h.update(line)
            offset += len(line)
            if line.strip():
                docs += 1
                seen += 1
                if docs == block_docs:
                    ranges.append((start, offset, docs, seen - docs))
                    start, docs = offset, 0
    if docs:
        ranges.append((start, offset, docs, seen - docs))
    return h.hexdigest(), ranges


def index_blocks(
    files: list[tuple[Path, str, str, int, str]],
    text_field: str,
    block_docs: int,
    fields: dict[int, str] | None = None,
) -> BlockIndex:
    """``files``: (path, relpath, format, ref index, role) in input order; ``fields``:
    a ref's own text field where it differs from ``text_field``."""
    import pyarrow.parquet as pq

    from stages.data_prep.refs import file_sha256

    sources: list[Source] = []
    blocks: list[Block] = []
    doc = 0
    for path, rel, fmt, ref, role in files:
        k = len(sources)
        if fmt == "parquet":
            digest = file_sha256(path)
            rows = pq.ParquetFile(path).metadata.num_rows
            ranges = [
                (s, min(s + block_docs, rows), min(block_docs, rows - s), s)
                for s in range(0, rows, block_docs)
            ]
        elif fmt in ("jsonl", "text"):
            digest, ranges = _scan_lines(path, block_docs)
        else:
            raise ItoError(ErrorCode.data_format_unsupported, f"unknown format {fmt!r}")
        sources.append(
            Source(
                str(path), rel, fmt, digest, path.stat().st_size, ref, role, (fields or {}).get(ref)
            )
        )
        for start, stop, n, first in ranges:
            blocks.append(Block(len(blocks), k, start, stop, doc, n, first))
            doc += n
    return BlockIndex(sources, blocks, text_field)


@dataclass
class BlockData:
    """One block's documents: the texts, and the records exactly as given."""

    texts: list[str]
    lines: list[bytes] | None = None  # jsonl: the raw lines (written back verbatim)
    table: pa.Table | None = None  # parquet: the rows


def read_block(index: BlockIndex, block: Block) -> BlockData:
    src = index.sources[block.source]
    field = src.text_field or index.text_field
    if src.format == "parquet":
        return _read_parquet(src, block, field)
    with open(src.path, "rb") as f:
        f.seek(block.start)
        raw = f.read(block.stop - block.start)
    lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    if src.format == "text":
        texts = [ln.decode("utf-8").rstrip("\r") for ln in lines]
        return BlockData(texts)
    texts = []
    for n, line in enumerate(lines):
        try:
            value = json.loads(line)[field]
        except (ValueError, KeyError, TypeError) as e:
            raise ItoError(
                ErrorCode.data_format_unsupported,
                f"{src.relpath}:{block.line_start + n + 1}: not a JSON object "
                f"with a {field!r} field ({type(e).__name__})",
            ) from e
        if not isinstance(value, str):
            raise ItoError(
                ErrorCode.data_format_unsupported,
                f"{src.relpath}:{block.line_start + n + 1}: {field!r} is not a string",
            )
        texts.append(value)
    return BlockData(texts, lines=lines)


def _read_parquet(src: Source, block: Block, field: str) -> BlockData:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src.path)
    parts, row = [], 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > block.start and row < block.stop:
            t = pf.read_row_group(g)
            parts.append(
                t.slice(max(block.start - row, 0), min(block.stop, row + n) - max(block.start, row))
            )
        row += n
    table = pa.concat_tables(parts) if parts else pa.table({})
    if field not in table.column_names:
        raise ItoError(ErrorCode.data_format_unsupported, f"{src.relpath}: no column {field!r}")
    texts = table.column(field).to_pylist()
    if not all(isinstance(t, str) for t in texts):
        raise ItoError(
            ErrorCode.data_format_unsupported, f"{src.relpath}: column {field!r} holds a non-string"
        )
    return BlockData(texts, table=table)
