"""Decontamination: find training documents that contain eval items.

Both sides are normalised the same way (``text.normalize_words``: NFKC, lower case,
punctuation and whitespace runs become word breaks), so a question re-cased,
re-punctuated or re-spaced still matches. Two methods:

- ``ngram`` (default, 13 words): a document is contaminated by an item when they share
  any word n-gram (the GPT-3 / Llama decontamination rule);
- ``overlap`` (8 words): contaminated when at least ``overlap_threshold`` of the
  item's distinct n-grams occur in the document (robust to a few edited words, and
  needs more than one shared phrase).

Items shorter than n words cannot form an n-gram; they match by exact occurrence of
their whole (normalised) word sequence in the document. Matching is vectorised: an
index of sorted n-gram hashes, ``searchsorted`` for membership, then counts per
(document, item) pair.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from stages.data_prep.config import DecontaminationConfig
from stages.data_prep.evals import EvalItem
from stages.data_prep.text import GramBatch, ngram_hashes, word_batch

# Documents matched per numpy batch.
MATCH_BATCH_DOCS = 4_096
# Matches kept per contaminated document in the provenance record (counts are exact).
MAX_MATCHES_PER_DOC = 5


@dataclass(frozen=True)
class Match:
    doc: int
    item: int  # index into the EvalIndex's items
    grams: int  # distinct item n-grams found in the document
    ratio: float  # grams / the item's distinct n-grams (1.0 for exact matches)
    method: str  # "ngram", "overlap" or "exact"


class MatchRow(TypedDict):
    """One match of a contaminated document, as the provenance record lists it."""

    suite: str
    item: int
    file: str
    method: str
    grams: int
    ratio: float


def match_rows(matches: Sequence[Match], items: Sequence[EvalItem]) -> list[MatchRow]:
    """One document's matches as provenance rows: at most MAX_MATCHES_PER_DOC, strongest
    first (the caller records the exact total)."""
    ms = sorted(matches, key=lambda m: (-m.ratio, -m.grams, m.item))
    return [
        {
            "suite": items[m.item].suite,
            "item": items[m.item].index,
            "file": items[m.item].file,
            "method": m.method,
            "grams": m.grams,
            "ratio": round(m.ratio, 4),
        }
        for m in ms[:MAX_MATCHES_PER_DOC]
    ]


def _unique_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(a) == 0:
        return a, b
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    keep = np.r_[True, (a[1:] != a[:-1]) | (b[1:] != b[:-1])]
    return a[keep], b[keep]


class _GramTable:
    """Sorted n-gram hashes with the item each came from (a gram may map to several)."""

    def __init__(self, grams: GramBatch, item_ids: np.ndarray):
        h, it = _unique_pairs(grams.hashes, item_ids[grams.doc])
        order = np.argsort(h, kind="stable")
        self.keys, self.items = h[order], it[order]

    def lookup(self, grams: GramBatch) -> tuple[np.ndarray, np.ndarray]:
        """(doc, item) for every distinct (doc, gram) hit, one row per item holding it."""
        if len(self.keys) == 0 or len(grams.hashes) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, grams.hashes), len(self.keys) - 1)
        hit = self.keys[pos] == grams.hashes
        doc, h = _unique_pairs(grams.doc[hit], grams.hashes[hit])
        left = np.searchsorted(self.keys, h, side="left")
        right = np.searchsorted(self.keys, h, side="right")
        width = right - left
        rows = np.repeat(np.arange(len(h)), width)
        within = np.arange(len(rows)) - np.repeat(np.cumsum(width) - width, width)
        return doc[rows], self.items[left[rows] + within]


class EvalIndex:
    def __init__(self, items: Sequence[EvalItem], cfg: DecontaminationConfig | None = None):
        self.items = list(items)
        self.cfg = cfg or DecontaminationConfig()
        self.n = self.cfg.ngram if self.cfg.mode == "ngram" else self.cfg.overlap_ngram
        wb = word_batch([it.text for it in self.items])
        ids = np.arange(len(self.items), dtype=np.int64)
        grams = ngram_hashes(wb, self.n, short="drop")
        self.table = _GramTable(grams, ids)
        # Distinct n-grams per item: the denominator of the overlap ratio.
        self.item_grams = np.bincount(self.table.items, minlength=len(self.items))
        # Short items (1..n-1 words): one whole-item "gram" per item, by length.
        self.short: dict[int, _GramTable] = {}
        for m in sorted(set(int(x) for x in wb.lengths if 0 < x < self.n)):
            sel = np.flatnonzero(wb.lengths == m)
            sub = word_batch([self.items[i].text for i in sel])
            self.short[m] = _GramTable(ngram_hashes(sub, m, short="drop"), sel)
        self.short_items = int(sum(len(np.unique(t.items)) for t in self.short.values()))

    def match(self, texts: Sequence[str]) -> list[Match]:
        """Matches of one batch of documents (doc indices local to ``texts``)."""
        wb = word_batch(texts)
        doc, item = self.table.lookup(ngram_hashes(wb, self.n, short="drop"))
        out: list[Match] = []
        if len(doc):
            codes, counts = np.unique(doc * len(self.items) + item, return_counts=True)
            for code, count in zip(codes.tolist(), counts.tolist(), strict=True):
                d, i = divmod(code, len(self.items))
                ratio = count / max(int(self.item_grams[i]), 1)
                if self.cfg.mode == "ngram" or ratio >= self.cfg.overlap_threshold:
                    out.append(Match(d, i, count, ratio, self.cfg.mode))
        for m, table in self.short.items():
            sd, si = table.lookup(ngram_hashes(wb, m, short="drop"))
            out += [
                Match(d, i, 1, 1.0, "exact") for d, i in zip(sd.tolist(), si.tolist(), strict=True)
            ]
        return out


@dataclass
class DecontamResult:
    contaminated: np.ndarray  # bool per document
    matches: list[Match]
    index: EvalIndex

    @property
    def num_contaminated(self) -> int:
        return int(self.contaminated.sum())

    def record(self, doc_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """The provenance section: method, parameters, counts, which item matched which
        document (at most MAX_MATCHES_PER_DOC per document, strongest first)."""
        cfg, items = self.index.cfg, self.index.items
        by_doc: dict[int, list[Match]] = {}
        for m in self.matches:
            by_doc.setdefault(m.doc, []).append(m)
        rows = []
        for d in sorted(by_doc):
            rows.append(
                {
                    "doc": doc_ids[d] if doc_ids is not None else d,
                    "matches": match_rows(by_doc[d], items),
                    "total_matches": len(by_doc[d]),
                }
            )
        per_suite = Counter(items[m.item].suite for m in self.matches)
        return {
            "method": cfg.mode,
            "parameters": {
                "ngram": self.index.n,
                "mode": cfg.mode,
                "action": cfg.action,
                "overlap_threshold": cfg.overlap_threshold if cfg.mode == "overlap" else None,
                "normalisation": "NFKC, lower case, split on non-alphanumerics",
                "short_item_fallback": "exact word-sequence match",
            },
            "eval_items": len(items),
            "eval_items_short": self.index.short_items,
            "documents_contaminated": self.num_contaminated,
            "eval_items_matched": len({m.item for m in self.matches}),
            "matches_by_suite": dict(sorted(per_suite.items())),
            "contaminated_documents": rows,
        }


def decontaminate(
    texts: Sequence[str], index: EvalIndex, cancelled: Callable[[], bool] = lambda: False
) -> DecontamResult:
    contaminated = np.zeros(len(texts), dtype=bool)
    matches: list[Match] = []
    for start in range(0, len(texts), MATCH_BATCH_DOCS):
        if cancelled():
            raise InterruptedError("decontamination cancelled")
        for m in index.match(texts[start : start + MATCH_BATCH_DOCS]):
            m = Match(m.doc + start, m.item, m.grams, m.ratio, m.method)
            contaminated[m.doc] = True
            matches.append(m)
    return DecontamResult(contaminated, matches, index)
