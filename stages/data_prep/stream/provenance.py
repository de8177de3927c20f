"""Provenance sections of a streaming run (the same shape the in-memory path writes)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from stages.data_prep.decontam import EvalIndex
from stages.data_prep.records import MAX_DUPLICATE_EXAMPLES
from stages.data_prep.stream.run import StreamResult


def dedup_section(res: StreamResult) -> dict[str, Any]:
    d = res.dedup
    assert d is not None, "a run with dedup"
    examples = [
        {"doc": res.blocks_index.doc_id(a), "survivor": res.blocks_index.doc_id(s)}
        for a, s in d["examples"][:MAX_DUPLICATE_EXAMPLES]
    ]
    return {
        "method": "exact blake2b, then MinHash LSH verified by exact Jaccard, connected "
        "components (streaming, bucket-partitioned)",
        "parameters": {
            "threshold": d["threshold"],
            "num_perm": d["num_perm"],
            "shingle_size": d["shingle_size"],
            "seed": d["seed"],
            "bands": d["bands"],
            "rows": d["rows"],
            "recall_target": d["recall_target"],
            "partitions": d["partitions"],
            "survivor": "lowest input index in the cluster",
        },
        "backend": res.executor,
        "shards": len(res.blocks_index.blocks),
        "exact_duplicates": d["exact_duplicates"],
        "near_duplicates": d["near_duplicates"],
        "clusters": d["clusters"],
        "candidate_pairs": d["candidate_pairs"],
        "verified_pairs": d["verified_pairs"],
        "near_duplicate_examples": examples,
    }


def decontam_section(res: StreamResult, index: EvalIndex) -> dict[str, Any]:
    cfg = index.cfg
    per_suite: Counter[str] = Counter()
    matched: set[int] = set()
    rows: list[dict[str, object]] = []
    for row in res.contaminated_documents:
        per_suite.update(row["suites"])
        matched.update(row["items"])
        rows.append(
            {"doc": row["doc"], "matches": row["matches"], "total_matches": row["total_matches"]}
        )
    return {
        "method": cfg.mode,
        "parameters": {
            "ngram": index.n,
            "mode": cfg.mode,
            "action": cfg.action,
            "overlap_threshold": cfg.overlap_threshold if cfg.mode == "overlap" else None,
            "normalisation": "NFKC, lower case, split on non-alphanumerics",
            "short_item_fallback": "exact word-sequence match",
        },
        "eval_items": len(index.items),
        "eval_items_short": index.short_items,
        "documents_contaminated": len(rows),
        "eval_items_matched": len(matched),
        "matches_by_suite": dict(sorted(per_suite.items())),
        "contaminated_documents": rows,
    }
