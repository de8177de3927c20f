"""The last streaming task, ``filter`` (per block): the block's survivors of exact and
near dedup, optionally decontaminated against the evals (removed, or kept with a flag
field), written as one output shard with every input field kept and a file of each
output row's input document id."""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from stages.data_prep.stream.blocks import BlockData, BlockIndex, read_block
from stages.data_prep.stream.shuffle import concat, gather, load_run, rel_path, text_bytes
from stages.data_prep.stream.store import (
    ContaminatedDocument,
    TaskRecord,
    TaskStats,
    WorkDir,
    atomic_write,
)
from stages.errors import ErrorCode, ItoError

if TYPE_CHECKING:
    from stages.data_prep.decontam import EvalIndex, Match

# Field added to a record kept with ``action: flag`` (the record's own fields are kept;
# a record that already has it is refused): ``params["flag_field"]``, by default this.
FLAG_FIELD = "contaminated"


@lru_cache(maxsize=2)
def _eval_index(root: str) -> EvalIndex:
    from stages.data_prep.config import DecontaminationConfig
    from stages.data_prep.decontam import EvalIndex
    from stages.data_prep.evals import EvalItem

    obj = json.loads((Path(root) / "evals.json").read_text())
    return EvalIndex(
        [EvalItem(**it) for it in obj["items"]], DecontaminationConfig(**obj["config"])
    )


def _drops(wd: WorkDir, b: int) -> tuple[np.ndarray, np.ndarray]:
    ex = concat(gather(wd, f"exact/p*/to-{b:05d}.npz"), "doc", np.int64)
    near = concat(gather(wd, f"components/to-{b:05d}.npz"), "doc", np.int64)
    return ex, near


def _records_out(
    blocks_index: BlockIndex,
    b: int,
    data: BlockData,
    keep: np.ndarray,
    flagged: np.ndarray,
    fmt: str,
    flag: str = FLAG_FIELD,
) -> bytes:
    src = blocks_index.sources[blocks_index.blocks[b].source]
    if flagged.any():
        taken = (data.table is not None and flag in data.table.column_names) or (
            data.lines is not None
            and any(flag in json.loads(data.lines[i]) for i in np.flatnonzero(flagged))
        )
        if taken:
            raise ItoError(
                ErrorCode.bad_request,
                f"flag field {flag!r} is already a field of the input records: name another",
            )
    idx = np.flatnonzero(keep)
    field = src.text_field or blocks_index.text_field
    if fmt == "jsonl":
        if data.lines is not None:
            rows = [
                data.lines[i]
                if not flagged[i]
                else json.dumps(
                    {**json.loads(data.lines[i]), flag: True}, ensure_ascii=False
                ).encode("utf-8")
                for i in idx
            ]
        elif data.table is not None:
            recs = data.table.take(pa.array(idx, type=pa.int64())).to_pylist()
            rows = [
                json.dumps(
                    {**r, **({flag: True} if flagged[i] else {})}, ensure_ascii=False, default=str
                ).encode("utf-8")
                for r, i in zip(recs, idx, strict=True)
            ]
        else:
            rows = [
                json.dumps(
                    {field: data.texts[i], **({flag: True} if flagged[i] else {})},
                    ensure_ascii=False,
                ).encode("utf-8")
                for i in idx
            ]
        return b"".join(r.rstrip(b"\r") + b"\n" for r in rows)
    import pyarrow.parquet as pq

    if data.table is not None:
        table = data.table.take(pa.array(idx, type=pa.int64()))
    elif data.lines is not None:
        table = pa.Table.from_pylist([json.loads(data.lines[i]) for i in idx])
    else:
        table = pa.table({field: pa.array([data.texts[i] for i in idx], type=pa.string())})
    if flagged.any():
        table = table.append_column(flag, pa.array(flagged[idx].tolist(), pa.bool_()))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue().to_pybytes())


def doc_id(blocks_index: BlockIndex, b: int, local: int) -> str:
    blk = blocks_index.blocks[b]
    src = blocks_index.sources[blk.source]
    return f"{src.ref}:{src.relpath}:{blk.line_start + local}"


def filter_block(root: str, b: int) -> TaskRecord:
    blocks_index, params, _ = load_run(root)
    wd = WorkDir(Path(root))
    blk = blocks_index.blocks[b]
    data = read_block(blocks_index, blk)
    n = len(data.texts)
    keep = np.ones(n, dtype=bool)
    ex, near = _drops(wd, b)
    keep[ex - blk.doc_start] = False
    keep[near - blk.doc_start] = False
    flagged = np.zeros(n, dtype=bool)
    contaminated: list[ContaminatedDocument] = []
    decon = params.get("decontamination")
    if decon:
        from stages.data_prep.decontam import match_rows

        index = _eval_index(root)
        live = np.flatnonzero(keep)
        by_doc: dict[int, list[Match]] = {}
        for m in index.match([data.texts[i] for i in live]):
            by_doc.setdefault(int(live[m.doc]), []).append(m)
        items = index.items
        for d in sorted(by_doc):
            ms = by_doc[d]
            contaminated.append(
                {
                    "doc": doc_id(blocks_index, b, d),
                    "index": blk.doc_start + d,
                    "matches": match_rows(ms, items),
                    "total_matches": len(ms),
                    "items": sorted({m.item for m in ms}),
                    "suites": dict(Counter(items[m.item].suite for m in ms)),
                }
            )
        hit = np.array(sorted(by_doc), dtype=np.int64)
        if decon["action"] == "remove":
            keep[hit] = False
        else:
            flagged[hit] = True
    fmt = params["output_format"]
    path = wd.path("out", f"part-{b:05d}.{fmt}")
    meta = atomic_write(
        path,
        _records_out(
            blocks_index, b, data, keep, flagged, fmt, params.get("flag_field", FLAG_FIELD)
        ),
    )
    ids_path = wd.path("out", f"part-{b:05d}.ids.txt")  # output row -> input document id
    ids_text = "".join(doc_id(blocks_index, b, int(i)) + "\n" for i in np.flatnonzero(keep))
    ids = atomic_write(ids_path, ids_text.encode("utf-8"))
    kept = [data.texts[i] for i in np.flatnonzero(keep)]
    stats: TaskStats = {
        "docs_in": n,
        "docs_out": len(kept),
        "bytes_in": text_bytes(data.texts),
        "bytes_out": text_bytes(kept),
        "exact_duplicates": len(ex),
        "near_duplicates": len(near),
        "contaminated": len(contaminated),
        "contaminated_documents": contaminated,
        "shard": path.name,
        "sha256": meta["sha256"],
        "shard_bytes": meta["bytes"],
    }
    stats["ids"] = ids_path.name
    return wd.record(
        "filter", str(b), {rel_path(wd, path): meta, rel_path(wd, ids_path): ids}, stats
    )
