"""Word normalisation and vectorised n-gram hashing, shared by dedup and decontamination.

Per-document Python work is limited to one regex split and one dict lookup per word;
everything after that (n-gram combination, MinHash permutations, matching) runs on
whole batches as numpy integer arrays. Hashes are stable across processes and
machines (blake2b per distinct word, never Python's salted ``hash``), so signatures
computed on Ray workers agree with those computed on the driver.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Letters and digits of any script; punctuation, symbols, underscores and whitespace
# separate words. "Janet\u2019s" and "janet's" both become ["janet", "s"].
_WORD = re.compile(r"[^\W_]+")
# Mixing constants (golden ratio, MurmurHash3 fmix64).
_K_MUL = np.uint64(0x9E3779B97F4A7C15)
_F1 = np.uint64(0xFF51AFD7ED558CCD)
_F2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
# The word-hash cache is bounded so a long-lived worker cannot grow without limit.
_WORD_CACHE_MAX = 4_000_000
_word_cache: dict[str, int] = {}


def normalize_words(text: str) -> list[str]:
    """NFKC, lower case, split on anything that is not a letter or digit."""
    if not text.isascii():  # ASCII is already NFKC; skip the costly call
        text = unicodedata.normalize("NFKC", text)
    return _WORD.findall(text.lower())


def word_hash(word: str) -> int:
    h = _word_cache.get(word)
    if h is None:
        if len(_word_cache) >= _WORD_CACHE_MAX:
            _word_cache.clear()
        h = int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")
        _word_cache[word] = h
    return h


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: an avalanching bijection (wrapping arithmetic)."""
    x = x ^ (x >> _S33)
    x = x * _F1
    x = x ^ (x >> _S33)
    x = x * _F2
    return x ^ (x >> _S33)


@dataclass(frozen=True)
class WordBatch:
    """The words of a batch of documents as one flat array of 64-bit word hashes."""

    hashes: np.ndarray  # uint64, all documents concatenated
    lengths: np.ndarray  # int64 words per document

    @property
    def offsets(self) -> np.ndarray:
        out = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out


def word_batch(texts: Sequence[str]) -> WordBatch:
    flat: list[int] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        words = normalize_words(text)
        lengths[i] = len(words)
        try:
            flat.extend([_word_cache[w] for w in words])
        except KeyError:  # first sight of some word: hash and cache it
            flat.extend([word_hash(w) for w in words])
    return WordBatch(np.array(flat, dtype=np.uint64), lengths)


@dataclass(frozen=True)
class GramBatch:
    """n-gram hashes of a batch: ``hashes[i]`` belongs to document ``doc[i]``."""

    hashes: np.ndarray  # uint64
    doc: np.ndarray  # int64, non-decreasing
    num_docs: int

    def counts(self) -> np.ndarray:
        return np.bincount(self.doc, minlength=self.num_docs)


def ngram_hashes(batch: WordBatch, n: int, *, short: str = "whole") -> GramBatch:
    """Hashes of every contiguous word n-gram of every document.

    ``short="whole"``: a document with 1..n-1 words yields one gram of all its words
    (dedup shingles); ``short="drop"``: it yields none (decontamination matches short
    eval items separately, by exact match). Empty documents yield nothing.
    """
    lengths = batch.lengths
    if short == "whole":
        per_doc = np.where(lengths > 0, np.maximum(lengths - n + 1, 1), 0)
    elif short == "drop":
        per_doc = np.maximum(lengths - n + 1, 0)
    else:
        raise ValueError(f"short must be 'whole' or 'drop', not {short!r}")
    total = int(per_doc.sum())
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), per_doc)
    if total == 0:
        return GramBatch(np.zeros(0, dtype=np.uint64), doc, len(lengths))
    offsets = batch.offsets
    gram_start_of_doc = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(per_doc, out=gram_start_of_doc[1:])
    # Start position (in the flat word array) of each gram.
    starts = offsets[doc] + (np.arange(total, dtype=np.int64) - gram_start_of_doc[doc])
    ends = offsets[doc + 1]
    words = batch.hashes
    acc = np.zeros(total, dtype=np.uint64)
    last = len(words) - 1
    for j in range(n):
        idx = starts + j
        valid = idx < ends
        step = acc * _K_MUL + words[np.minimum(idx, last)]
        acc = np.where(valid, step, acc) if not valid.all() else step
    return GramBatch(fmix64(acc), doc, len(lengths))
