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
7. ``filter`` (per block, ``filter.py``): the survivors of the block, optionally
   decontaminated, written as one output shard with every input field kept.

The shuffle files and the run's index are read and written through ``shuffle.py``.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np

from stages.data_prep.dedup import jaccard_sorted, sketch_texts
from stages.data_prep.minhash import Banding, band_keys, bucket_pairs, unique_pairs
from stages.data_prep.stream.blocks import BlockData, BlockIndex, read_block
from stages.data_prep.stream.filter import filter_block
from stages.data_prep.stream.shuffle import (
    block_of,
    concat,
    gather,
    load_run,
    rel_path,
    scatter,
    text_bytes,
)
from stages.data_prep.stream.store import FileMeta, TaskRecord, TaskStats, WorkDir, write_arrays
from stages.data_prep.text import fmix64, ngram_hashes, word_batch

# Dropped -> survivor examples kept by the components task for the provenance record.
MAX_EXAMPLES = 1_000
_SHINGLE_BATCH = 8_192


# --------------------------------------------------------------------------- dedup
def sketch(root: str, b: int) -> TaskRecord:
    blocks_index, params, _ = load_run(root)
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
    outputs = scatter(
        wd,
        f"sketch/band/b{b:05d}",
        (fmix64(keys) % np.uint64(n_parts)).astype(np.int64),
        n_parts,
        key=keys,
        doc=np.repeat(docs[nonempty], bands),
        hi=np.repeat(ex[nonempty, 0], bands),
        lo=np.repeat(ex[nonempty, 1], bands),
    )
    outputs |= scatter(
        wd,
        f"sketch/exact/b{b:05d}",
        (fmix64(ex[:, 0].copy()) % np.uint64(n_parts)).astype(np.int64),
        n_parts,
        hi=ex[:, 0].copy(),
        lo=ex[:, 1].copy(),
        doc=docs,
    )
    stats: TaskStats = {"docs": len(docs), "bytes": text_bytes(data.texts), "band_rows": len(keys)}
    return wd.record("sketch", str(b), outputs, stats)


def exact(root: str, p: int) -> TaskRecord:
    _, _, starts = load_run(root)
    wd = WorkDir(Path(root))
    parts = gather(wd, f"sketch/exact/b*/to-{p:05d}.npz")
    hi, lo = concat(parts, "hi", np.uint64), concat(parts, "lo", np.uint64)
    doc = concat(parts, "doc", np.int64)
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
    outputs = scatter(
        wd,
        f"exact/p{p:05d}",
        block_of(starts, doc[dup]),
        len(starts),
        doc=doc[dup],
        survivor=survivor[dup],
    )
    return wd.record("exact", str(p), outputs, {"exact_duplicates": int(dup.sum())})


def candidates(root: str, p: int) -> TaskRecord:
    _, _, starts = load_run(root)
    wd = WorkDir(Path(root))
    parts = gather(wd, f"sketch/band/b*/to-{p:05d}.npz")
    key, doc = concat(parts, "key", np.uint64), concat(parts, "doc", np.int64)
    hi, lo = concat(parts, "hi", np.uint64), concat(parts, "lo", np.uint64)
    rows = len(key)
    # Exact copies share every bucket: keep only the first (lowest) of each in a bucket,
    # as the in-memory dedup bands only the exact-dedup survivors.
    order = np.lexsort((doc, lo, hi, key))
    key, doc, hi, lo = key[order], doc[order], hi[order], lo[order]
    if rows:
        keep = np.r_[True, (key[1:] != key[:-1]) | (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])]
        key, doc = key[keep], doc[keep]
    pairs = unique_pairs(bucket_pairs(key, doc))
    outputs = scatter(
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


def fetch(root: str, b: int) -> TaskRecord:
    blocks_index, params, starts = load_run(root)
    wd = WorkDir(Path(root))
    parts = gather(wd, f"candidates/p*/to-{b:05d}.npz")
    pairs = unique_pairs(
        np.stack([concat(parts, "i", np.int64), concat(parts, "j", np.int64)], axis=1)
    )
    outputs: dict[str, FileMeta] = {}
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
            outputs[rel_path(wd, path)] = write_arrays(
                path,
                i=sel[:, 0].copy(),
                j=sel[:, 1].copy(),
                docs=need,
                offsets=sub_off,
                flat=sub_flat,
            )
    return wd.record("fetch", str(b), outputs, {"pairs": len(pairs)})


def verify(root: str, b: int) -> TaskRecord:
    blocks_index, params, _ = load_run(root)
    wd = WorkDir(Path(root))
    threshold = params["dedup"]["threshold"]
    edges: list[tuple[int, int]] = []
    n_pairs = 0
    parts = gather(wd, f"fetch/b*/to-{b:05d}.npz")
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
    outputs = {rel_path(wd, path): write_arrays(path, i=e[:, 0].copy(), j=e[:, 1].copy())}
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


def components(root: str, _task: int = 0) -> TaskRecord:
    _, _, starts = load_run(root)
    wd = WorkDir(Path(root))
    parts = gather(wd, "verify/b*.npz")
    i, j = concat(parts, "i", np.int64), concat(parts, "j", np.int64)
    nodes, root_of = connected_components(i, j)
    dropped = nodes != root_of
    outputs = scatter(
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
    stats: TaskStats = {
        "verified_pairs": len(i),
        "clusters": len(np.unique(root_of)),
        "near_duplicates": int(dropped.sum()),
        "examples": examples,
    }
    return wd.record("components", "0", outputs, stats)


TASKS = {
    "sketch": sketch,
    "exact": exact,
    "candidates": candidates,
    "fetch": fetch,
    "verify": verify,
    "components": components,
    "filter": filter_block,
}
