"""Word normalisation and vectorised n-gram hashing, shared by dedup and decontamination.

Words are what ``normalize_words`` returns (NFKC, lower case, runs of letters and
digits). ``word_batch`` finds and hashes them for a whole batch at once on the UTF-8
bytes: an ASCII document (the common case; ASCII is already NFKC) goes straight into
one byte array, where a 256-entry table lower-cases letters and marks every byte that
is not a letter or digit as a break; any other document is first normalised by
``normalize_words`` and re-joined with spaces, so both paths yield the same words
(tested against ``normalize_words`` on mixed scripts). The only per-document Python
work is ``str.isascii`` (and the regex for non-ASCII documents).

A word's hash chains MurmurHash3's fmix64 over its UTF-8 bytes in 8-byte chunks, seeded
with its length (``word_hash``); for a batch, the chunks are unaligned 8-byte loads at
the word starts found in the byte array, so a word of up to 8 bytes costs one gather
and one fmix64. Hashes are stable across processes and machines (no salted ``hash``),
so signatures computed on Ray workers agree with those computed on the driver. n-gram
hashes combine the word hashes of each window (``ngram_hashes``).
"""

from __future__ import annotations

import itertools
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
_M64 = (1 << 64) - 1
# Byte -> word byte after lower-casing, or 0 for a break. In a document on the byte
# path every byte >= 0x80 belongs to a word: ASCII documents have none, and the
# re-joined words of a normalised document have only spaces between them.
_WORD_BYTE = np.zeros(256, dtype=np.uint8)
for _c in b"0123456789abcdefghijklmnopqrstuvwxyz":
    _WORD_BYTE[_c] = _c
for _c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ":
    _WORD_BYTE[_c] = _c + 32
_WORD_BYTE[0x80:] = np.arange(0x80, 0x100, dtype=np.uint8)


def normalize_words(text: str) -> list[str]:
    """NFKC, lower case, split on anything that is not a letter or digit."""
    if not text.isascii():  # ASCII is already NFKC; skip the costly call
        text = unicodedata.normalize("NFKC", text)
    return _WORD.findall(text.lower())


def _fmix64_int(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def word_hash(word: str) -> int:
    """The 64-bit hash ``word_batch`` gives ``word`` (one word of ``normalize_words``):
    h = len * K, then h = fmix64(h ^ chunk) for each 8-byte little-endian chunk of its
    UTF-8 bytes (the last one zero-padded)."""
    data = word.encode("utf-8")
    h = (len(data) * int(_K_MUL)) & _M64
    for at in range(0, len(data), 8):
        h = _fmix64_int(h ^ int.from_bytes(data[at : at + 8], "little"))
    return h


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: an avalanching bijection (wrapping arithmetic)."""
    x = x ^ (x >> _S33)
    x = x * _F1
    x = x ^ (x >> _S33)
    x = x * _F2
    out: np.ndarray = x ^ (x >> _S33)
    return out


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


# Documents are hashed in passes of about this many bytes: the per-byte arrays stay
# in cache, and memory does not grow with the batch.
_PASS_BYTES = 1 << 20
# _TAIL_MASK[k]: the low k bytes of a little-endian 8-byte load (k = 0..8).
_TAIL_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


def _hash_pass(text: str, doc_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(word hashes, words per document) of documents joined by single spaces in
    ``text`` (``doc_sizes``: each one's UTF-8 bytes)."""
    # A break after the last word, then 8 zero bytes so every 8-byte load is in bounds.
    c = np.take(_WORD_BYTE, np.frombuffer(text.encode("utf-8") + bytes(9), dtype=np.uint8))
    edge = np.diff((c != 0).view(np.int8), prepend=np.int8(0))  # +1 word start, -1 end
    starts = np.flatnonzero(edge == 1)
    length = np.flatnonzero(edge == -1) - starts
    # Unaligned little-endian 8-byte loads at every byte offset (a view, no copy).
    load = np.ndarray((len(c) - 7,), dtype="<u8", buffer=c, strides=(1,))
    h = fmix64(
        (length.astype(np.uint64) * _K_MUL) ^ (load[starts] & _TAIL_MASK[np.minimum(length, 8)])
    )
    longer = np.flatnonzero(length > 8)  # words of more than one 8-byte chunk
    at = 8
    while len(longer):
        rest = length[longer] - at
        h[longer] = fmix64(
            h[longer] ^ (load[starts[longer] + at] & _TAIL_MASK[np.minimum(rest, 8)])
        )
        longer = longer[rest > 8]
        at += 8
    doc_start = np.zeros(len(doc_sizes) + 1, dtype=np.int64)
    np.cumsum(doc_sizes + 1, out=doc_start[1:])
    return h, np.diff(np.searchsorted(starts, doc_start))


def word_batch(texts: Sequence[str]) -> WordBatch:
    """Every document's words (as ``normalize_words`` splits them), hashed."""
    pieces: list[str] = []
    sizes = np.empty(len(texts), dtype=np.int64)  # UTF-8 bytes of each piece
    passes = [0]
    pass_bytes = 0
    for i, text in enumerate(texts):
        if text.isascii():
            size = len(text)
        else:
            text = " ".join(normalize_words(text))
            size = len(text.encode("utf-8"))
        if pass_bytes and pass_bytes + size >= _PASS_BYTES:
            passes.append(i)
            pass_bytes = 0
        pass_bytes += size + 1
        sizes[i] = size
        pieces.append(text)
    if not texts:
        return WordBatch(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))
    passes.append(len(texts))
    hashes, lengths = [], []
    for a, b in itertools.pairwise(passes):
        h, n = _hash_pass(" ".join(pieces[a:b]), sizes[a:b])
        hashes.append(h)
        lengths.append(n)
    return WordBatch(np.concatenate(hashes), np.concatenate(lengths).astype(np.int64))


@dataclass(frozen=True)
class GramBatch:
    """n-gram hashes of a batch: ``hashes[i]`` belongs to document ``doc[i]``."""

    hashes: np.ndarray  # uint64
    doc: np.ndarray  # int64, non-decreasing
    num_docs: int

    def counts(self) -> np.ndarray:
        return np.bincount(self.doc, minlength=self.num_docs)


def ngram_hashes(batch: WordBatch, n: int, *, short: str = "whole") -> GramBatch:
    """Hashes of every contiguous word n-gram of every document: fmix64 of
    ``((w0 * K + w1) * K + ...) + w_{n-1}`` over the window's word hashes.

    ``short="whole"``: a document with 1..n-1 words yields one gram of all its words
    (dedup shingles); ``short="drop"``: it yields none (decontamination matches short
    eval items separately, by exact match). Empty documents yield nothing.
    """
    lengths = batch.lengths
    if short not in ("whole", "drop"):
        raise ValueError(f"short must be 'whole' or 'drop', not {short!r}")
    full = lengths >= n
    is_short = (lengths > 0) & ~full if short == "whole" else np.zeros(len(lengths), bool)
    per_doc = np.where(full, lengths - n + 1, 0) + is_short
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), per_doc)
    total = len(doc)
    if total == 0:
        return GramBatch(np.zeros(0, dtype=np.uint64), doc, len(lengths))
    words = batch.hashes
    offsets = batch.offsets
    out = np.empty(total, dtype=np.uint64)
    short_slot = np.zeros(total, dtype=bool)
    if is_short.any():
        gram_start = np.cumsum(per_doc) - per_doc
        short_slot[gram_start[is_short]] = True
        out[short_slot] = _whole_doc_grams(words, offsets, lengths, np.flatnonzero(is_short))
    if full.any():
        # Every window of n consecutive words in the flat array, by slices; then keep
        # the windows that start and end in one document.
        w = len(words) - n + 1
        acc = words[:w].copy()
        for j in range(1, n):
            acc *= _K_MUL
            acc += words[j : j + w]
        mark = np.zeros(w + 1, dtype=np.int32)  # +1 at a document's first window, -1 past its last
        fd = np.flatnonzero(full)
        mark[offsets[fd]] += 1  # distinct positions within each of the two updates
        mark[offsets[fd] + lengths[fd] - n + 1] -= 1
        out[~short_slot] = acc[np.cumsum(mark[:w]) > 0]
    return GramBatch(fmix64(out), doc, len(lengths))


def _whole_doc_grams(
    words: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, docs: np.ndarray
) -> np.ndarray:
    """One gram of all the words of each of ``docs`` (each has fewer than n words)."""
    acc = np.zeros(len(docs), dtype=np.uint64)
    starts, lens = offsets[docs], lengths[docs]
    for j in range(int(lens.max())):
        live = lens > j
        acc[live] = acc[live] * _K_MUL + words[starts[live] + j]
    return acc
