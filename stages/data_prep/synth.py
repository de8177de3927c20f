"""Synthetic corpora with planted near-duplicates, and exact ground truth.

Used by the tests and ``benchmarks/data_prep.py`` to measure dedup's pair-level
precision and recall. Ground truth is computed on word-shingle *tuples* (not on the
hashes dedup uses), so it is independent of the code under test.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from itertools import combinations, count

from stages.data_prep.text import normalize_words

Pair = tuple[int, int]


def shingle_tuples(text: str, k: int) -> set[tuple[str, ...]]:
    words = normalize_words(text)
    if 0 < len(words) < k:
        return {tuple(words)}
    return {tuple(words[i : i + k]) for i in range(len(words) - k + 1)}


def jaccard(a: set[tuple[str, ...]], b: set[tuple[str, ...]]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def _edit_towards(
    words: list[str],
    target: float,
    k: int,
    rng: random.Random,
    fresh: Iterator[str],
    tolerance: float = 0.02,
) -> list[str]:
    """Random word edits (replace, insert, delete) until Jaccard(original, copy) falls
    to ``target`` or just below; returns the copy. An interior edit breaks ~k shingles,
    so when one would undershoot by more than ``tolerance``, an edit at the end (one
    shingle) is made instead."""
    base = shingle_tuples(" ".join(words), k)

    def sim(ws: list[str]) -> float:
        return jaccard(base, shingle_tuples(" ".join(ws), k))

    copy = list(words)
    while sim(copy) > target and len(copy) > k:
        pos = rng.randrange(len(copy))
        op = rng.random()
        cand = list(copy)
        if op < 0.5:
            cand[pos] = next(fresh)
        elif op < 0.75:
            cand.insert(pos, next(fresh))
        else:
            del cand[pos]
        if sim(cand) < target - tolerance:
            cand = copy[:-1] if rng.random() < 0.5 else [*copy, next(fresh)]
        copy = cand
    return copy


def planted_pair_corpus(
    n_docs: int,
    n_pairs: int,
    *,
    words_per_doc: int = 80,
    jaccard_range: tuple[float, float] = (0.3, 0.95),
    shingle_size: int = 5,
    vocab_size: int = 30_000,
    seed: int = 0,
) -> tuple[list[str], list[Pair]]:
    """``n_docs`` random documents, then ``n_pairs`` edited copies of randomly chosen
    ones with a target Jaccard drawn uniformly from ``jaccard_range``. Returns the texts
    (copies shuffled in) and the planted (original, copy) index pairs."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(vocab_size)]
    fresh = (f"x{i}" for i in count())  # words no original uses
    originals = [[rng.choice(vocab) for _ in range(words_per_doc)] for _ in range(n_docs)]
    sources = rng.sample(range(n_docs), n_pairs)
    copies = [
        _edit_towards(originals[s], rng.uniform(*jaccard_range), shingle_size, rng, fresh)
        for s in sources
    ]
    docs = [(" ".join(w), i) for i, w in enumerate(originals)]
    docs += [(" ".join(w), -1 - j) for j, w in enumerate(copies)]
    rng.shuffle(docs)
    position = {tag: pos for pos, (_, tag) in enumerate(docs)}
    planted = [tuple(sorted((position[s], position[-1 - j]))) for j, s in enumerate(sources)]
    return [t for t, _ in docs], [(a, b) for a, b in planted]


def similar_pairs_bruteforce(texts: Sequence[str], k: int, threshold: float) -> set[Pair]:
    """Every pair with exact shingle Jaccard >= threshold, by checking all n^2/2 pairs."""
    sets = [shingle_tuples(t, k) for t in texts]
    return {
        (i, j)
        for i, j in combinations(range(len(texts)), 2)
        if jaccard(sets[i], sets[j]) >= threshold
    }


def similar_pairs_exact(texts: Sequence[str], k: int, threshold: float) -> set[Pair]:
    """Same answer as the brute force (a pair with Jaccard > 0 shares a shingle), via an
    inverted index, for corpora too large for n^2."""
    sets = [shingle_tuples(t, k) for t in texts]
    postings: dict[tuple[str, ...], list[int]] = {}
    for i, s in enumerate(sets):
        for sh in s:
            postings.setdefault(sh, []).append(i)
    candidates = {
        (a, b) for docs in postings.values() if len(docs) > 1 for a, b in combinations(docs, 2)
    }
    return {(i, j) for i, j in candidates if jaccard(sets[i], sets[j]) >= threshold}


def cluster_pairs(clusters: Iterable[Sequence[int]]) -> set[Pair]:
    return {(a, b) for c in clusters for a, b in combinations(sorted(c), 2)}


def precision_recall(predicted: set[Pair], truth: set[Pair]) -> tuple[float, float]:
    tp = len(predicted & truth)
    precision = tp / len(predicted) if predicted else 1.0
    recall = tp / len(truth) if truth else 1.0
    return precision, recall
