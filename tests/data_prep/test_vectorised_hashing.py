"""The vectorised word, shingle and band hashing against plain per-document references,
and near-duplicates that differ only in what normalisation removes."""

from __future__ import annotations

import random
from collections import defaultdict
from itertools import combinations

import numpy as np
import pytest

import stages.data_prep.text as text_mod
from stages.data_prep.config import DedupConfig
from stages.data_prep.dedup import (
    _stable_argsort_u32,
    dedup,
    jaccard_sorted,
    pair_jaccard,
    sketch_texts,
)
from stages.data_prep.minhash import (
    MAX_BUCKET_ALL_PAIRS,
    Banding,
    band_keys,
    bucket_pairs,
    candidate_pairs,
    lsh_params,
)
from stages.data_prep.minhash import unique_pairs as unique_pair_rows
from stages.data_prep.synth import jaccard, planted_pair_corpus, shingle_tuples
from stages.data_prep.text import (
    WordBatch,
    fmix64,
    ngram_hashes,
    normalize_words,
    word_batch,
    word_hash,
)

M64 = (1 << 64) - 1
K = 0x9E3779B97F4A7C15

# Every way a word can start, end or be cut: case, digits, underscores, punctuation
# runs, control bytes, words of 1, 8, 9, 16, 17 and 40 bytes (the 8-byte chunk edges),
# and scripts that go through NFKC (ligature, fullwidth, Kelvin sign, dotted capital I,
# CJK, combining marks, a right single quote).
MIXED = [
    "",
    "   ",
    "a",
    "The cat SAT on the mat, and then it sat again!",
    "snake_case and kebab-case and dot.separated, 3.14 1,000",
    "abcdefgh abcdefghi abcdefghabcdefgh abcdefghabcdefghX " + "q" * 40,
    "\x00nul\x00inside\ttabs\nnew\r\nlines\x7f",
    "Janet\u2019s ducks lay 16 eggs per day",
    "\ufb01ne \uff26\uff35\uff2c\uff2c-width \u212a \u0130stanbul Stra\u00dfe",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 and Caf\u00e9 cafe\u0301 na\u00efve",
    "\u00c0\u00c9 \u00fc_\u00fc \u0391\u03b8\u03ae\u03bd\u03b1 "
    "\u041c\u043e\u0441\u043a\u0432\u0430!",
]


def _reference_words(texts: list[str]) -> list[list[int]]:
    return [[word_hash(w) for w in normalize_words(t)] for t in texts]


def _fuzz_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ0189 _.,;-\t\n\u2019\u00e9\u65e5\ufb01\uff21" + "abcdefgh" * 4
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]


@pytest.mark.parametrize("pass_bytes", [1 << 20, 48])
def test_word_batch_finds_and_hashes_the_words_normalize_words_finds(
    monkeypatch: pytest.MonkeyPatch, pass_bytes: int
) -> None:
    # 48 bytes: many passes, and documents longer than a pass in a pass of their own.
    monkeypatch.setattr(text_mod, "_PASS_BYTES", pass_bytes)
    texts = MIXED + _fuzz_texts(400, seed=1) + planted_pair_corpus(20, 5, seed=2)[0]
    wb = word_batch(texts)
    offsets = wb.offsets
    got = [[int(h) for h in wb.hashes[offsets[i] : offsets[i + 1]]] for i in range(len(texts))]
    assert got == _reference_words(texts)
    assert wb.lengths.dtype == np.int64 and int(wb.lengths.sum()) > 2000


def test_word_hash_tells_apart_words_that_share_8_byte_chunks() -> None:
    words = [
        "abcdefgh",
        "abcdefgh0",
        "abcdefgha",
        "abcdefghabcdefgh",
        "abcdefghabcdefgh0",
        "habcdefg",
        "a",
        "aa",
        "\u00e9",
        "e\u0301",
    ]
    words += [f"w{i}" for i in range(20_000)] + [f"x{i:020d}" for i in range(20_000)]
    hashes = {word_hash(w) for w in words}
    assert len(hashes) == len(words)


def _reference_ngrams(wb: WordBatch, n: int, short: str) -> tuple[list[int], list[int]]:
    """Per document, in Python: fold each window with h * K + w, then fmix64."""
    hashes, docs = [], []
    offsets = wb.offsets
    for d in range(len(wb.lengths)):
        words = [int(x) for x in wb.hashes[offsets[d] : offsets[d + 1]]]
        if len(words) >= n:
            windows = [words[i : i + n] for i in range(len(words) - n + 1)]
        elif words and short == "whole":
            windows = [words]
        else:
            windows = []
        for window in windows:
            acc = 0
            for w in window:
                acc = (acc * K + w) & M64
            hashes.append(acc)
            docs.append(d)
    mixed = fmix64(np.array(hashes, dtype=np.uint64)) if hashes else np.zeros(0, np.uint64)
    return [int(h) for h in mixed], docs


@pytest.mark.parametrize("n", [1, 2, 5, 13])
@pytest.mark.parametrize("short", ["whole", "drop"])
def test_ngram_hashes_match_a_per_document_reference(n: int, short: str) -> None:
    rng = np.random.default_rng(n)
    lengths = rng.integers(0, 20, size=300).astype(np.int64)
    lengths[:3] = [0, n - 1 if n > 1 else 0, n]  # empty, one short of n, exactly n
    wb = WordBatch(rng.integers(0, 2**63, int(lengths.sum()), dtype=np.uint64), lengths)
    grams = ngram_hashes(wb, n, short=short)
    ref_hashes, ref_docs = _reference_ngrams(wb, n, short)
    assert [int(h) for h in grams.hashes] == ref_hashes
    assert grams.doc.tolist() == ref_docs
    assert grams.num_docs == len(lengths)


def test_band_keys_fold_each_band_of_the_signature() -> None:
    sig = np.random.default_rng(0).integers(0, 2**32, (50, 128), dtype=np.uint64)
    sig = sig.astype(np.uint32)
    keys = band_keys(sig, Banding(21, 6))
    assert keys.shape == (50, 21)
    for d in (0, 17, 49):
        for band in (0, 7, 20):
            acc = band
            for v in sig[d, band * 6 : band * 6 + 6]:
                acc = (acc * K + int(v)) & M64
            assert int(keys[d, band]) == acc


def _reference_bucket_pairs(keys: np.ndarray, docs: np.ndarray) -> set[tuple[int, int]]:
    buckets: dict[int, list[int]] = defaultdict(list)
    for k, d in zip(keys.tolist(), docs.tolist(), strict=True):
        buckets[k].append(d)
    out: set[tuple[int, int]] = set()
    for members in buckets.values():
        members.sort()
        if len(members) <= MAX_BUCKET_ALL_PAIRS:
            out.update(combinations(members, 2))
        else:
            out.update((members[0], m) for m in members[1:])
    return out


def test_bucket_pairs_in_any_document_order() -> None:
    rng = np.random.default_rng(3)
    docs = rng.permutation(400).astype(np.int64)  # not ascending
    keys = rng.integers(0, 150, 400).astype(np.uint64)  # buckets of 0..~8 members
    keys[docs >= 350] = np.uint64(10**12)  # one bucket of 50: linked as a star
    pairs = bucket_pairs(keys, docs)
    assert (pairs[:, 0] < pairs[:, 1]).all()
    assert {(int(i), int(j)) for i, j in pairs} == _reference_bucket_pairs(keys, docs)
    assert len(pairs) == len({(int(i), int(j)) for i, j in pairs})  # once per bucket


def test_unique_pairs_narrow_and_wide_ids() -> None:
    rng = np.random.default_rng(4)
    narrow = np.sort(rng.integers(0, 1000, (500, 2)), axis=1)
    wide = narrow + np.int64(2**33)  # past the packed path's 32-bit halves
    for pairs in (narrow, wide):
        np.testing.assert_array_equal(unique_pair_rows(pairs), np.unique(pairs, axis=0))


def test_near_duplicates_that_differ_in_case_punctuation_spacing_and_width_are_found() -> None:
    texts, _ = planted_pair_corpus(200, 0, seed=8)
    a, b, c = texts[3], texts[50], texts[120]
    variants = [
        a.upper().replace(" ", " ,  "),  # same words: Jaccard 1
        "  " + b.replace(" ", "\t") + "!!",
        # Fullwidth letters and digits fold to ASCII under NFKC: the same words again.
        "".join(chr(ord(ch) + 0xFEE0) if ch.isalnum() else ch for ch in c),
        a.rsplit(" ", 1)[0] + " Zz\u2019",  # last word changed: Jaccard 75/77
    ]
    corpus = texts + variants
    result = dedup(corpus, DedupConfig(threshold=0.8))
    assert result.exact_duplicates == 0  # none is byte-identical to another
    assert result.clusters == [[3, 200, 203], [50, 201], [120, 202]]
    assert not result.keep[200:].any() and result.keep[[3, 50, 120]].all()
    # Every verified pair really is a near-duplicate by the word-tuple definition.
    for i, j in result.verified_pairs:
        assert jaccard(shingle_tuples(corpus[i], 5), shingle_tuples(corpus[j], 5)) >= 0.8


def test_pair_jaccard_equals_jaccard_sorted_pair_by_pair() -> None:
    rng = np.random.default_rng(5)
    sets = [
        np.unique(rng.integers(0, 60, rng.integers(1, 40))).astype(np.uint64) for _ in range(80)
    ]
    sets += [
        sets[0].copy(),
        np.array([2**64 - 1], dtype=np.uint64),
        np.arange(500, dtype=np.uint64),
        # All below the next set's first element, which the probing set holds: a
        # search that ran past its set's end would count it.
        np.array([1, 2, 3], dtype=np.uint64),
        np.array([900, 901], dtype=np.uint64),
    ]
    offsets = np.zeros(len(sets) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in sets], out=offsets[1:])
    flat = np.concatenate(sets)
    a = rng.integers(0, len(sets), 600)
    b = rng.integers(0, len(sets), 600)
    # Equal sets, one element, big vs small, and the set just before [900, 901].
    a[:5], b[:5] = [0, 81, 82, 5, 84], [80, 81, 3, 82, 83]
    got = pair_jaccard(flat, offsets, a, b)
    want = [jaccard_sorted(sets[i], sets[j]) for i, j in zip(a, b, strict=True)]
    assert got.tolist() == want
    assert got[0] == 1.0 and got[1] == 1.0


def test_dedup_verifies_the_candidates_as_the_per_pair_check_does() -> None:
    texts, _ = planted_pair_corpus(300, 300, seed=9)
    # Documents that repeat a phrase: their shingle lists hold duplicates, and a
    # Jaccard over lists instead of sets would differ.
    phrase = texts[0].split()[:12]
    looped = " ".join(phrase * 6)
    texts += [looped, looped + " " + " ".join(phrase[:6]) + " tail words here", looped + " end"]
    cfg = DedupConfig(threshold=0.8)
    result = dedup(texts, cfg)
    sk = sketch_texts(texts, cfg.shingle_size, cfg.num_perm, cfg.seed)
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm, cfg.recall_target)
    cand = candidate_pairs(sk.sig, Banding(bands, rows), np.diff(sk.offsets) > 0)

    def shingle_set(i: int) -> np.ndarray:
        return np.unique(sk.shingles[sk.offsets[i] : sk.offsets[i + 1]])

    want = [
        (int(i), int(j))
        for i, j in cand
        if jaccard_sorted(shingle_set(int(i)), shingle_set(int(j))) >= cfg.threshold
    ]
    assert result.verified_pairs.tolist() == [list(p) for p in want]
    assert 60 <= len(want) < len(cand)  # some candidates are rejected


@pytest.mark.parametrize("high", [1 << 16, 1 << 32])
def test_stable_argsort_of_32_bit_keys(high: int) -> None:
    rng = np.random.default_rng(6)
    v = rng.integers(0, high, 50_000, dtype=np.int64)
    v[::3] = v[::3] % 97  # many ties, whose input order must survive
    np.testing.assert_array_equal(_stable_argsort_u32(v), np.argsort(v, kind="stable"))
