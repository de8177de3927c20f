"""Exact and near-duplicate removal: exact hash, MinHash LSH, Jaccard check, union-find.

Recipe (``dedup``):
1. exact: later copies of a document's exact text are dropped;
2. sketch: word shingles (``shingle_size`` words) -> 64-bit hashes -> MinHash signature
   (``minhash.signatures``), on Ray workers when the input is large;
3. candidates: LSH bands (``minhash.lsh_params``) over the exact-dedup survivors;
4. verify: exact Jaccard of the two shingle-hash sets >= threshold (drops LSH's false
   positives, so precision does not depend on the sketch);
5. cluster: union-find over verified pairs; the survivor of a cluster is its member
   with the lowest input index (the order refs, files and lines were given in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from stages.data_prep.config import DedupConfig
from stages.data_prep.minhash import Banding, candidate_pairs, lsh_params, signatures
from stages.data_prep.text import ngram_hashes, word_batch
from stages.errors import ErrorCode, ItoError

# Documents hashed per numpy batch on one process: bounds peak memory of the
# (num_perm x shingles) matrix and the flat word arrays.
SKETCH_BATCH_DOCS = 8_192


@dataclass(frozen=True)
class Sketch:
    """Signatures plus every document's shingle hashes (for the exact Jaccard check)."""

    sig: np.ndarray  # (docs, num_perm) uint32
    shingles: np.ndarray  # uint64, all documents' shingle hashes, document by document
    offsets: np.ndarray  # int64 (docs + 1)

    def shingle_sets(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat, offsets): the sorted unique shingle hashes of each of ``docs``, as
        ``flat[offsets[k] : offsets[k + 1]]`` for ``docs[k]``, built in one sort (only
        candidate documents ever need them)."""
        starts = self.offsets[docs]
        lens = self.offsets[docs + 1] - starts
        label = np.repeat(np.arange(len(docs), dtype=np.int64), lens)
        h = self.shingles[_ranges(starts, lens)]
        # By hash, then stably by document: 4x faster than lexsort((h, label)).
        order = np.argsort(h)
        order = order[_stable_argsort_u32(label[order])]
        h, label = h[order], label[order]
        first = np.ones(len(h), dtype=bool)
        first[1:] = (h[1:] != h[:-1]) | (label[1:] != label[:-1])
        h, label = h[first], label[first]
        return h, np.searchsorted(label, np.arange(len(docs) + 1))


def _stable_argsort_u32(v: np.ndarray) -> np.ndarray:
    """Stable argsort of integers in [0, 2**32): numpy radix-sorts 16-bit keys, so
    one pass per 16-bit half, low half first."""
    order = np.argsort((v & 0xFFFF).astype(np.uint16), kind="stable")
    if len(v) and int(v.max()) >= 1 << 16:
        order = order[np.argsort((v[order] >> 16).astype(np.uint16), kind="stable")]
    return order


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each (s, n)."""
    ends = np.cumsum(lens)
    out: np.ndarray = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + np.repeat(
        starts - (ends - lens), lens
    )
    return out


def pair_jaccard(flat: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact Jaccard of the sorted unique sets ``a[p]`` and ``b[p]`` (indices into
    ``offsets``) for every pair p at once: each element of the smaller set is looked up
    in the larger by a binary search run for all elements side by side (as many steps
    as the largest set has bits), then the hits are counted per pair. The same value
    as ``jaccard_sorted`` pair by pair (two empty sets: 1.0)."""
    size = np.diff(offsets)
    swap = size[a] > size[b]
    small, big = np.where(swap, b, a), np.where(swap, a, b)
    n_probe = size[small]
    pair = np.repeat(np.arange(len(a), dtype=np.int64), n_probe)
    x = flat[_ranges(offsets[small], n_probe)]
    lo, end = offsets[big][pair], offsets[big + 1][pair]
    hi = end.copy()
    last = max(len(flat) - 1, 0)
    for _ in range(int(size.max(initial=0)).bit_length()):
        mid = (lo + hi) >> 1
        live = lo < hi
        less = live & (flat[np.minimum(mid, last)] < x)
        lo = np.where(less, mid + 1, lo)
        hi = np.where(live & ~less, mid, hi)
    hit = (lo < end) & (flat[np.minimum(lo, last)] == x)
    inter = np.bincount(pair[hit], minlength=len(a)).astype(np.float64)
    union = size[a] + size[b] - inter
    jaccard: np.ndarray = np.divide(inter, union, out=np.ones(len(a)), where=union > 0)
    return jaccard


def sketch_texts(texts: Sequence[str], shingle_size: int, num_perm: int, seed: int) -> Sketch:
    sigs, shingles, lens = [], [], []
    for start in range(0, len(texts), SKETCH_BATCH_DOCS):
        grams = ngram_hashes(word_batch(texts[start : start + SKETCH_BATCH_DOCS]), shingle_size)
        sigs.append(signatures(grams, num_perm, seed))
        shingles.append(grams.hashes)
        lens.append(grams.counts())
    if not sigs:
        return Sketch(
            np.zeros((0, num_perm), dtype=np.uint32),
            np.zeros(0, dtype=np.uint64),
            np.zeros(1, dtype=np.int64),
        )
    lengths = np.concatenate(lens)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Sketch(np.concatenate(sigs), np.concatenate(shingles), offsets)


def _concat_sketches(parts: Sequence[Sketch], num_perm: int) -> Sketch:
    if not parts:
        return sketch_texts([], 1, num_perm, 1)
    lengths = np.concatenate([np.diff(p.offsets) for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Sketch(
        np.concatenate([p.sig for p in parts]), np.concatenate([p.shingles for p in parts]), offsets
    )


def sketch_sharded(texts: Sequence[str], cfg: DedupConfig) -> tuple[Sketch, int]:
    """Sketch on Ray workers (one task per ``cfg.shard_docs`` documents) when Ray is
    initialised; the driver keeps banding and verification, which are cheap."""
    import ray

    task = ray.remote(num_cpus=1)(sketch_texts)
    refs = [
        task.remote(list(texts[s : s + cfg.shard_docs]), cfg.shingle_size, cfg.num_perm, cfg.seed)
        for s in range(0, len(texts), cfg.shard_docs)
    ]
    parts = ray.get(refs, timeout=cfg.shard_timeout_s)
    return _concat_sketches(parts, cfg.num_perm), len(refs)


def jaccard_sorted(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) == 0 and len(y) == 0:
        return 1.0
    inter = len(np.intersect1d(x, y, assume_unique=True))
    return inter / (len(x) + len(y) - inter)


class UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        p = self.parent
        root = x
        while p[root] != root:
            root = int(p[root])
        while p[x] != root:  # path compression
            p[x], x = root, int(p[x])
        return root

    def union(self, x: int, y: int) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:  # the lower index becomes the root: the survivor rule for free
            self.parent[max(rx, ry)] = min(rx, ry)


@dataclass
class DedupResult:
    keep: np.ndarray  # bool per input document
    exact_duplicates: int
    near_duplicates: int
    clusters: list[list[int]]  # near-dup clusters (>= 2 members), survivor first
    candidate_pairs: int
    verified_pairs: np.ndarray  # (k, 2) int64 with Jaccard >= threshold
    bands: int
    rows: int
    shards: int
    backend: str

    def duplicate_of(self) -> dict[int, int]:
        """Dropped near-duplicate -> its cluster's survivor."""
        return {m: c[0] for c in self.clusters for m in c[1:]}


def exact_duplicate_mask(texts: Sequence[str]) -> np.ndarray:
    """True for every document whose exact text appeared earlier in the input.

    A set of the strings themselves: equal text is equal bytes, the comparison is exact
    (no digest collisions) and it holds references, not copies."""
    seen: set[str] = set()
    dup = np.zeros(len(texts), dtype=bool)
    for i, t in enumerate(texts):
        if t in seen:
            dup[i] = True
        else:
            seen.add(t)
    return dup


def dedup(
    texts: Sequence[str],
    cfg: DedupConfig | None = None,
    *,
    use_ray: bool | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> DedupResult:
    """Exact + near-duplicate removal over ``texts`` (see the module docstring).

    ``use_ray``: None shards over Ray when Ray is initialised and the input has at
    least ``cfg.ray_min_docs`` documents; True requires Ray; False never uses it.
    """
    cfg = cfg or DedupConfig()
    n = len(texts)
    exact = exact_duplicate_mask(texts)
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm, cfg.recall_target)
    if use_ray is None:
        use_ray = n >= cfg.ray_min_docs and _ray_ready()
    if use_ray:
        if not _ray_ready():  # never start a cluster from inside a stage
            raise ItoError(ErrorCode.ray_unavailable, "sharded dedup needs ray.init() first")
        sk, shards = sketch_sharded(texts, cfg)
        backend = "ray"
    else:
        sk, shards, backend = (
            sketch_texts(texts, cfg.shingle_size, cfg.num_perm, cfg.seed),
            1,
            "local",
        )
    if cancelled():
        raise InterruptedError("dedup cancelled")
    eligible = ~exact & (np.diff(sk.offsets) > 0)
    cand = candidate_pairs(sk.sig, Banding(bands, rows), eligible)
    docs, inverse = np.unique(cand.ravel(), return_inverse=True)
    flat, offsets = sk.shingle_sets(docs)
    pairs_at = inverse.reshape(-1, 2)
    jac = pair_jaccard(flat, offsets, pairs_at[:, 0], pairs_at[:, 1])
    verified = [(int(i), int(j)) for i, j in cand[jac >= cfg.threshold]]
    uf = UnionFind(n)
    for i, j in verified:
        uf.union(i, j)
    groups: dict[int, list[int]] = {}
    for i, j in verified:
        for x in (i, j):
            groups.setdefault(uf.find(x), []).append(x)
    clusters = sorted(sorted(set(m)) for m in groups.values())
    keep = ~exact
    for c in clusters:
        keep[c[1:]] = False
    near = sum(len(c) - 1 for c in clusters)
    return DedupResult(
        keep=keep,
        exact_duplicates=int(exact.sum()),
        near_duplicates=near,
        clusters=clusters,
        candidate_pairs=len(cand),
        verified_pairs=np.array(verified, dtype=np.int64).reshape(-1, 2),
        bands=bands,
        rows=rows,
        shards=shards,
        backend=backend,
    )


def _ray_ready() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return bool(ray.is_initialized())
