"""Vectorised MinHash signatures and LSH banding.

Signatures are bit-identical to ``datasketch.MinHash(num_perm, seed)`` in its 2.0
default scheme ("affine32": fmix32 of the 32-bit value, then ``a*h + b mod 2**32``)
when datasketch is given the same 32-bit shingle values through an identity
``hashfunc`` (tests check this), so a signature from here can seed a datasketch
``LeanMinHash``/``MinHashLSH`` and vice versa. The difference is speed: one numpy
pass over all shingles of a batch instead of a Python object per document.

Banding (b bands of r rows) follows the S-curve P(candidate | s) = 1 - (1 - s**r)**b.
Candidates are verified with exact Jaccard afterwards, so a false positive costs only
a verification while a false negative is a duplicate kept forever; ``lsh_params``
therefore takes the largest r (fewest spurious candidates) whose S-curve still
catches a pair at the threshold with probability >= ``recall_target``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from datasketch import MinHash

from stages.data_prep.text import GramBatch

_U32_MAX = np.uint32(0xFFFFFFFF)
# Elements of the (num_perm x shingles) permutation matrix per chunk: 2**20 x 4 B =
# 4 MiB, reused for every chunk, so the multiply, add and min run in cache (a 16 MiB
# chunk took 2-3x longer here) and memory stays flat however long a document is.
_CHUNK_ELEMENTS = 1 << 20
# A band bucket larger than this is connected as a star (first member to each other)
# instead of all pairs, so a template repeated 10k times costs 10k checks, not 50M.
MAX_BUCKET_ALL_PAIRS = 32
_BAND_MUL = np.uint64(0x9E3779B97F4A7C15)


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's own (a, b) for this seed and the affine32 scheme."""
    a, b = MinHash(num_perm=num_perm, seed=seed).permutations
    return np.asarray(a, dtype=np.uint32), np.asarray(b, dtype=np.uint32)


def fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    out: np.ndarray = x ^ (x >> np.uint32(16))
    return out


def shingle_values32(grams: GramBatch) -> np.ndarray:
    """The 32-bit values MinHash sees for each shingle (low half of the 64-bit hash)."""
    return (grams.hashes & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def signatures(grams: GramBatch, num_perm: int, seed: int = 1) -> np.ndarray:
    """(num_docs, num_perm) uint32 MinHash signatures; an empty document's row is all
    0xFFFFFFFF (datasketch's empty sketch)."""
    a, b = permutations(num_perm, seed)
    out = np.full((grams.num_docs, num_perm), _U32_MAX, dtype=np.uint32)
    if len(grams.hashes) == 0:
        return out
    hv = fmix32(shingle_values32(grams))
    doc = grams.doc
    chunk = max(_CHUNK_ELEMENTS // num_perm, 1)
    buf = np.empty((num_perm, min(chunk, len(hv))), dtype=np.uint32)
    # Fixed-size column chunks; a document cut by a chunk edge is min-combined with
    # what its earlier chunk wrote.
    for first in range(0, len(hv), chunk):
        last = min(first + chunk, len(hv))
        d = doc[first:last]
        seg = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])  # one segment per document
        phv = buf[:, : last - first]
        np.multiply(a[:, None], hv[None, first:last], out=phv)  # uint32, wraps mod 2**32
        phv += b[:, None]
        mins = np.minimum.reduceat(phv, seg, axis=1)  # (num_perm, documents in chunk)
        rows = d[seg]
        out[rows] = np.minimum(out[rows], mins.T)
    return out


def candidate_probability(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s**rows) ** bands


def lsh_params(threshold: float, num_perm: int, recall_target: float = 0.99) -> tuple[int, int]:
    """(bands, rows): the largest ``rows`` with P(candidate | s=threshold) >= target,
    bands = num_perm // rows. Falls back to rows=1 (every shared value a candidate)."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= recall_target:
            return bands, rows
    return num_perm, 1


@dataclass(frozen=True)
class Banding:
    bands: int
    rows: int


def bucket_pairs(keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Pairs (i, j) of documents that share a bucket key: all pairs of a bucket of up to
    ``MAX_BUCKET_ALL_PAIRS`` members, a star from its lowest member above that.

    ``keys`` and ``docs`` are parallel (any order; a document appears at most once per
    key). Pairs come out with i < j, possibly repeated across buckets."""
    if len(keys) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    # Only keys need ordering (an unstable sort is ~5x faster than lexsort here); the
    # few buckets that form pairs are put in document order below.
    order = np.argsort(keys)
    sk, sd = keys[order], docs[order].astype(np.int64)
    brk = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1], True])
    sizes = np.diff(brk)
    multi = np.flatnonzero(sizes >= 2)
    pairs: list[np.ndarray] = []
    two = multi[sizes[multi] == 2]
    if len(two):
        x, y = sd[brk[two]], sd[brk[two] + 1]
        pairs.append(np.stack([np.minimum(x, y), np.maximum(x, y)], axis=1))
    for g in multi[sizes[multi] > 2]:
        members = np.sort(sd[brk[g] : brk[g + 1]])
        if len(members) <= MAX_BUCKET_ALL_PAIRS:
            ii, jj = np.triu_indices(len(members), k=1)
            pairs.append(np.stack([members[ii], members[jj]], axis=1))
        else:
            pairs.append(np.stack([np.full(len(members) - 1, members[0]), members[1:]], axis=1))
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    return np.concatenate(pairs)


def unique_pairs(p: np.ndarray) -> np.ndarray:
    """Sorted unique rows of an (k, 2) int64 pair array with i < j."""
    if len(p) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if p.max() < 2**32:  # one uint64 per pair: a 1-D unique, several times faster
        packed = np.unique((p[:, 0].astype(np.uint64) << np.uint64(32)) | p[:, 1].astype(np.uint64))
        return np.stack([packed >> np.uint64(32), packed & np.uint64(0xFFFFFFFF)], axis=1).astype(
            np.int64
        )
    return np.unique(p, axis=0)


def band_keys(sig: np.ndarray, banding: Banding) -> np.ndarray:
    """(docs, bands) uint64 bucket keys: per band, its index then its ``rows`` values
    folded in with ``key * K + value``."""
    bands, rows = banding.bands, banding.rows
    cols = sig[:, : bands * rows].reshape(len(sig), bands, rows).astype(np.uint64)
    key = np.broadcast_to(np.arange(bands, dtype=np.uint64), (len(sig), bands)).copy()
    for c in range(rows):
        key *= _BAND_MUL
        key += cols[:, :, c]
    return key


def candidate_pairs(
    sig: np.ndarray, banding: Banding, eligible: np.ndarray | None = None
) -> np.ndarray:
    """Unique (i, j), i < j, pairs of rows that share at least one band.

    ``eligible`` masks rows that take part (e.g. non-empty, not exact duplicates)."""
    idx_all = np.arange(len(sig), dtype=np.int64)
    if eligible is not None:
        idx_all = idx_all[eligible]
    keys = band_keys(sig[idx_all], banding)
    pairs = [
        bucket_pairs(np.ascontiguousarray(keys[:, band]), idx_all) for band in range(banding.bands)
    ]
    pairs = [p for p in pairs if len(p)]
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    return unique_pairs(np.concatenate(pairs))
