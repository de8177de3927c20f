"""The tasks of streaming dedup and filtering: pure functions of files in a work folder.

Every task reads its inputs from files of finished upstream tasks, writes its outputs
atomically, then records itself done (``WorkDir.record``), so it can run in this
process or in any Ray worker, be retried, or be skipped on resume, and always gives
the same bytes. Shuffles are files keyed by destination: a map task writes one file
per destination partition or block, the reduce task reads every file addressed to it.

Stages of dedup (``B`` input blocks, ``P`` bucket partitions):

1. ``sketch`` (per block): exact digest (blake2b-128) and MinHash signature of each
   document (``dedup.sketch_texts``, the vectorised code); one row per (band, document)
   with the band's bucket key, shuffled to partition ``fmix64(key) % P``; one row per
   document with its digest, shuffled by digest.
2. ``exact`` (per partition): documents whose digest appeared at a lower index.
3. ``candidates`` (per partition): buckets of each band (``minhash.bucket_pairs``),
   exact copies collapsed to their first member first; pairs shuffled to the block of
   their lower document.
4. ``fetch`` (per block): unique candidate pairs; the shingle sets of their lower
   documents from this block's text, shuffled to the block of the higher document.
5. ``verify`` (per block): exact Jaccard of each pair against the higher document's
   shingles read from this block's text; pairs >= threshold are edges.
6. ``components`` (one task, on a worker): connected components of the edges
   (min-label propagation with pointer jumping over the edges' own nodes, so its memory
   is proportional to the verified pairs); every member but the lowest is dropped,
   shuffled to its block.
7. ``filter`` (per block): the survivors of the block, optionally decontaminated, written
   as one output shard with every input field kept.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from stages.data_prep.dedup import jaccard_sorted, sketch_texts
from stages.data_prep.minhash import Banding, band_keys, bucket_pairs, unique_pairs
from stages.data_prep.stream.blocks import BlockData, BlockIndex, read_block
from stages.data_prep.stream.store import WorkDir, atomic_write, read_arrays, write_arrays
from stages.data_prep.text import fmix64, ngram_hashes, word_batch
from stages.errors import ErrorCode, ItoError

# Field added to a record kept with ``action: flag`` (the record's own fields are kept;
# a record that already has it is refused): ``params["flag_field"]``, by default this.
FLAG_FIELD = "contaminated"
# Dropped -> survivor examples kept by the components task for the provenance record.
MAX_EXAMPLES = 1_000
_SHINGLE_BATCH = 8_192


@lru_cache(maxsize=4)
def _load(root: str) -> tuple[BlockIndex, dict[str, Any], np.ndarray]:
    r = Path(root)
    # "plan.json": a stored file name (written by run.py), kept for compatibility.
    blocks_index = BlockIndex.from_json(json.loads((r / "plan.json").read_text()))
    params = json.loads((r / "params.json").read_text())
    starts = np.array([b.doc_start for b in blocks_index.blocks], dtype=np.int64)
    return blocks_index, params, starts


def block_of(starts: np.ndarray, docs: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, docs, side="right") - 1


def _rel(wd: WorkDir, p: Path) -> str:
    return p.relative_to(wd.root).as_posix()


def _scatter(
    wd: WorkDir, folder: str, dest: np.ndarray, n_dest: int, **cols: np.ndarray
) -> dict[str, dict[str, Any]]:
    """Write the rows of ``cols`` to ``<folder>/to-<d>.npz`` per destination ``d`` (only
    the non-empty ones); returns the outputs for the task's done record."""
    outputs: dict[str, dict[str, Any]] = {}
    if len(dest) == 0:
        return outputs
    order = np.argsort(dest, kind="stable")
    sd = dest[order]
    cuts = np.flatnonzero(np.r_[True, sd[1:] != sd[:-1], True])
    for a, z in itertools.pairwise(cuts):
        d = int(sd[a])
        assert 0 <= d < n_dest
        sel = order[a:z]
        path = wd.path(folder, f"to-{d:05d}.npz")
        outputs[_rel(wd, path)] = write_arrays(path, **{k: v[sel] for k, v in cols.items()})
    return outputs


def _gather(wd: WorkDir, pattern: str) -> list[dict[str, np.ndarray]]:
    return [read_arrays(p) for p in sorted(wd.root.glob(pattern))]


def _cat(parts: list[dict[str, np.ndarray]], key: str, dtype: Any) -> np.ndarray:
    arrs = [p[key] for p in parts]
    return np.concatenate(arrs).astype(dtype, copy=False) if arrs else np.zeros(0, dtype)


def text_bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


# --------------------------------------------------------------------------- dedup
def sketch(root: str, b: int) -> dict[str, Any]:
    blocks_index, params, _ = _load(root)
    wd, d = WorkDir(Path(root)), params["dedup"]
    blk = blocks_index.blocks[b]
    data = read_block(blocks_index, blk)
    docs = blk.doc_start + np.arange(len(data.texts), dtype=np.int64)
    digests = b"".join(
        hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest() for t in data.texts
    )
    ex = np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2)
    sk = sketch_texts(data.texts, d["shingle_size"], d["num_perm"], d["seed"])
    nonempty = np.diff(sk.offsets) > 0
    keys = band_keys(sk.sig[nonempty], Banding(d["bands"], d["rows"])).ravel()
    bands = d["bands"]
    n_parts = params["partitions"]
    outputs = _scatter(
        wd,
        f"sketch/band/b{b:05d}",
        (fmix64(keys) % np.uint64(n_parts)).astype(np.int64),
        n_parts,
        key=keys,
        doc=np.repeat(docs[nonempty], bands),
        hi=np.repeat(ex[nonempty, 0], bands),
        lo=np.repeat(ex[nonempty, 1], bands),
    )
    outputs |= _scatter(
        wd,
        f"sketch/exact/b{b:05d}",
        (fmix64(ex[:, 0].copy()) % np.uint64(n_parts)).astype(np.int64),
        n_parts,
        hi=ex[:, 0].copy(),
        lo=ex[:, 1].copy(),
        doc=docs,
    )
    stats = {"docs": len(docs), "bytes": text_bytes(data.texts), "band_rows": len(keys)}
    return wd.record("sketch", str(b), outputs, stats)


def exact(root: str, p: int) -> dict[str, Any]:
    _, _, starts = _load(root)
    wd = WorkDir(Path(root))
    parts = _gather(wd, f"sketch/exact/b*/to-{p:05d}.npz")
    hi, lo = _cat(parts, "hi", np.uint64), _cat(parts, "lo", np.uint64)
    doc = _cat(parts, "doc", np.int64)
    order = np.lexsort((doc, lo, hi))
    hi, lo, doc = hi[order], lo[order], doc[order]
    first = (
        np.r_[True, (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])]
        if len(doc)
        else np.zeros(0, dtype=bool)
    )
    survivor = (
        doc[np.maximum.accumulate(np.where(first, np.arange(len(doc)), 0))] if len(doc) else doc
    )
    dup = ~first
    outputs = _scatter(
        wd,
        f"exact/p{p:05d}",
        block_of(starts, doc[dup]),
        len(starts),
        doc=doc[dup],
        survivor=survivor[dup],
    )
    return wd.record("exact", str(p), outputs, {"exact_duplicates": int(dup.sum())})


def candidates(root: str, p: int) -> dict[str, Any]:
    _, _, starts = _load(root)
    wd = WorkDir(Path(root))
    parts = _gather(wd, f"sketch/band/b*/to-{p:05d}.npz")
    key, doc = _cat(parts, "key", np.uint64), _cat(parts, "doc", np.int64)
    hi, lo = _cat(parts, "hi", np.uint64), _cat(parts, "lo", np.uint64)
    rows = len(key)
    # Exact copies share every bucket: keep only the first (lowest) of each in a bucket,
    # as the in-memory dedup bands only the exact-dedup survivors.
    order = np.lexsort((doc, lo, hi, key))
    key, doc, hi, lo = key[order], doc[order], hi[order], lo[order]
    if rows:
        keep = np.r_[True, (key[1:] != key[:-1]) | (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])]
        key, doc = key[keep], doc[keep]
    pairs = unique_pairs(bucket_pairs(key, doc))
    outputs = _scatter(
        wd,
        f"candidates/p{p:05d}",
        block_of(starts, pairs[:, 0]),
        len(starts),
        i=pairs[:, 0].copy(),
        j=pairs[:, 1].copy(),
    )
    return wd.record("candidates", str(p), outputs, {"band_rows": rows, "pairs": len(pairs)})


def shingle_sets(texts: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat): the sorted unique shingle hashes of each document."""
    flats, lens = [], []
    for s in range(0, len(texts), _SHINGLE_BATCH):
        g = ngram_hashes(word_batch(texts[s : s + _SHINGLE_BATCH]), k)
        order = np.lexsort((g.hashes, g.doc))
        h, dd = g.hashes[order], g.doc[order]
        first = (
            np.r_[True, (h[1:] != h[:-1]) | (dd[1:] != dd[:-1])]
            if len(h)
            else np.zeros(0, dtype=bool)
        )
        flats.append(h[first])
        lens.append(np.bincount(dd[first], minlength=g.num_docs))
    lengths = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(flats) if flats else np.zeros(0, np.uint64)
    return offsets, flat


def _block_shingles(
    blocks_index: BlockIndex, b: int, docs: np.ndarray, k: int, data: BlockData | None = None
) -> tuple[np.ndarray, np.ndarray]:
    blk = blocks_index.blocks[b]
    data = data or read_block(blocks_index, blk)
    return shingle_sets([data.texts[int(i)] for i in docs - blk.doc_start], k)


def fetch(root: str, b: int) -> dict[str, Any]:
    blocks_index, params, starts = _load(root)
    wd = WorkDir(Path(root))
    parts = _gather(wd, f"candidates/p*/to-{b:05d}.npz")
    pairs = unique_pairs(np.stack([_cat(parts, "i", np.int64), _cat(parts, "j", np.int64)], axis=1))
    outputs: dict[str, dict[str, Any]] = {}
    if len(pairs):
        lows = np.unique(pairs[:, 0])
        offsets, flat = _block_shingles(blocks_index, b, lows, params["dedup"]["shingle_size"])
        dest = block_of(starts, pairs[:, 1])
        order = np.argsort(dest, kind="stable")
        cuts = np.flatnonzero(np.r_[True, dest[order][1:] != dest[order][:-1], True])
        for a, z in itertools.pairwise(cuts):
            sel = pairs[order[a:z]]
            need = np.unique(sel[:, 0])
            pos = np.searchsorted(lows, need)
            lens = offsets[pos + 1] - offsets[pos]
            sub_off = np.zeros(len(need) + 1, dtype=np.int64)
            np.cumsum(lens, out=sub_off[1:])
            sub_flat = np.concatenate([flat[offsets[q] : offsets[q + 1]] for q in pos])
            path = wd.path(f"fetch/b{b:05d}", f"to-{int(dest[order[a]]):05d}.npz")
            outputs[_rel(wd, path)] = write_arrays(
                path,
                i=sel[:, 0].copy(),
                j=sel[:, 1].copy(),
                docs=need,
                offsets=sub_off,
                flat=sub_flat,
            )
    return wd.record("fetch", str(b), outputs, {"pairs": len(pairs)})


def verify(root: str, b: int) -> dict[str, Any]:
    blocks_index, params, _ = _load(root)
    wd = WorkDir(Path(root))
    threshold = params["dedup"]["threshold"]
    edges: list[tuple[int, int]] = []
    n_pairs = 0
    parts = _gather(wd, f"fetch/b*/to-{b:05d}.npz")
    highs = np.unique(np.concatenate([p["j"] for p in parts])) if parts else np.zeros(0, np.int64)
    if len(highs):
        h_off, h_flat = _block_shingles(blocks_index, b, highs, params["dedup"]["shingle_size"])
        for part in parts:
            l_off, l_flat, l_docs = part["offsets"], part["flat"], part["docs"]
            li = np.searchsorted(l_docs, part["i"])
            hj = np.searchsorted(highs, part["j"])
            n_pairs += len(li)
            for x, y, i, j in zip(
                li.tolist(), hj.tolist(), part["i"].tolist(), part["j"].tolist(), strict=True
            ):
                s = jaccard_sorted(l_flat[l_off[x] : l_off[x + 1]], h_flat[h_off[y] : h_off[y + 1]])
                if s >= threshold:
                    edges.append((i, j))
    e = np.array(sorted(edges), dtype=np.int64).reshape(-1, 2)
    path = wd.path("verify", f"b{b:05d}.npz")
    outputs = {_rel(wd, path): write_arrays(path, i=e[:, 0].copy(), j=e[:, 1].copy())}
    return wd.record(
        "verify", str(b), outputs, {"candidate_pairs": n_pairs, "verified_pairs": len(e)}
    )


def connected_components(i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, root) of the graph with edges (i, j): ``root`` is the lowest node of each
    node's component. Vectorised min-label propagation with pointer jumping on the
    edges' own nodes (memory ~ edges, not the corpus)."""
    nodes, inv = np.unique(np.concatenate([i, j]), return_inverse=True)
    u, v = inv[: len(i)], inv[len(i) :]
    label = np.arange(len(nodes), dtype=np.int64)  # nodes are sorted: min id = min index
    while True:
        m = np.minimum(label[u], label[v])
        new = label.copy()
        np.minimum.at(new, u, m)
        np.minimum.at(new, v, m)
        while True:  # pointer jumping: follow labels to their fixed point
            jumped = new[new]
            if np.array_equal(jumped, new):
                break
            new = jumped
        if np.array_equal(new, label):
            return nodes, nodes[label]
        label = new


def components(root: str, _task: int = 0) -> dict[str, Any]:
    _, _, starts = _load(root)
    wd = WorkDir(Path(root))
    parts = _gather(wd, "verify/b*.npz")
    i, j = _cat(parts, "i", np.int64), _cat(parts, "j", np.int64)
    nodes, root_of = connected_components(i, j)
    dropped = nodes != root_of
    outputs = _scatter(
        wd,
        "components",
        block_of(starts, nodes[dropped]),
        len(starts),
        doc=nodes[dropped],
        survivor=root_of[dropped],
    )
    examples = [
        [int(a), int(s)]
        for a, s in zip(nodes[dropped][:MAX_EXAMPLES], root_of[dropped][:MAX_EXAMPLES], strict=True)
    ]
    stats = {
        "verified_pairs": len(i),
        "clusters": len(np.unique(root_of)),
        "near_duplicates": int(dropped.sum()),
        "examples": examples,
    }
    return wd.record("components", "0", outputs, stats)


# -------------------------------------------------------------------------- filter
@lru_cache(maxsize=2)
def _eval_index(root: str) -> Any:
    from stages.data_prep.config import DecontaminationConfig
    from stages.data_prep.decontam import EvalIndex
    from stages.data_prep.evals import EvalItem

    obj = json.loads((Path(root) / "evals.json").read_text())
    return EvalIndex(
        [EvalItem(**it) for it in obj["items"]], DecontaminationConfig(**obj["config"])
    )


def _drops(wd: WorkDir, b: int) -> tuple[np.ndarray, np.ndarray]:
    ex = _cat(_gather(wd, f"exact/p*/to-{b:05d}.npz"), "doc", np.int64)
    near = _cat(_gather(wd, f"components/to-{b:05d}.npz"), "doc", np.int64)
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


def filter_block(root: str, b: int) -> dict[str, Any]:
    blocks_index, params, _ = _load(root)
    wd = WorkDir(Path(root))
    blk = blocks_index.blocks[b]
    data = read_block(blocks_index, blk)
    n = len(data.texts)
    keep = np.ones(n, dtype=bool)
    ex, near = _drops(wd, b)
    keep[ex - blk.doc_start] = False
    keep[near - blk.doc_start] = False
    flagged = np.zeros(n, dtype=bool)
    contaminated: list[dict[str, Any]] = []
    decon = params.get("decontamination")
    if decon:
        from stages.data_prep.decontam import MAX_MATCHES_PER_DOC

        index = _eval_index(root)
        live = np.flatnonzero(keep)
        by_doc: dict[int, list[Any]] = {}
        for m in index.match([data.texts[i] for i in live]):
            by_doc.setdefault(int(live[m.doc]), []).append(m)
        for d in sorted(by_doc):
            ms = sorted(by_doc[d], key=lambda m: (-m.ratio, -m.grams, m.item))
            items = index.items
            contaminated.append(
                {
                    "doc": doc_id(blocks_index, b, d),
                    "index": blk.doc_start + d,
                    "matches": [
                        {
                            "suite": items[m.item].suite,
                            "item": items[m.item].index,
                            "file": items[m.item].file,
                            "method": m.method,
                            "grams": m.grams,
                            "ratio": round(m.ratio, 4),
                        }
                        for m in ms[:MAX_MATCHES_PER_DOC]
                    ],
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
    stats = {
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
    return wd.record("filter", str(b), {_rel(wd, path): meta, _rel(wd, ids_path): ids}, stats)


TASKS = {
    "sketch": sketch,
    "exact": exact,
    "candidates": candidates,
    "fetch": fetch,
    "verify": verify,
    "components": components,
    "filter": filter_block,
}
