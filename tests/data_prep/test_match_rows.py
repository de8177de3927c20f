"""The provenance rows of one contaminated document (the in-process record and the
streaming filter task both write them): strongest match first, at most
MAX_MATCHES_PER_DOC of them, ratio rounded to four places."""

from __future__ import annotations

from stages.data_prep.decontam import MAX_MATCHES_PER_DOC, Match, match_rows
from stages.data_prep.evals import EvalItem


def test_rows_strongest_first_and_capped() -> None:
    items = [EvalItem("gsm8k", "test.jsonl", i, f"q{i}") for i in range(MAX_MATCHES_PER_DOC + 2)]
    # Ratios rise with the item number; a tie on ratio is broken by grams, then item.
    matches = [Match(0, i, 3, i / 7, "ngram") for i in range(len(items))]
    matches.append(Match(0, 0, 9, 0.0, "ngram"))
    rows = match_rows(matches, items)
    assert len(rows) == MAX_MATCHES_PER_DOC
    assert [r["item"] for r in rows] == [6, 5, 4, 3, 2]
    assert rows[0] == {
        "suite": "gsm8k",
        "item": 6,
        "file": "test.jsonl",
        "method": "ngram",
        "grams": 3,
        "ratio": round(6 / 7, 4),
    }
    tied = [Match(0, i, g, 0.5, "overlap") for i, g in ((0, 3), (1, 4), (2, 4))]
    assert [r["item"] for r in match_rows(tied, items)] == [1, 2, 0]
