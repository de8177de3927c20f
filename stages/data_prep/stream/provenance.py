"""Provenance sections of a streaming run (the same shape the in-memory path writes)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from stages.data_prep.decontam import EvalIndex
from stages.data_prep.records import MAX_DUPLICATE_EXAMPLES
from stages.data_prep.stream.run import StreamResult


def dedup_section(res: StreamResult) -> dict[str, Any]:
    d = res.dedup or {}
    examples = [
        {"doc": res.blocks_index.doc_id(a), "survivor": res.blocks_index.doc_id(s)}
        for a, s in d.get("examples", [])[:MAX_DUPLICATE_EXAMPLES]
    ]
    return {
        "method": "exact blake2b, then MinHash LSH verified by exact Jaccard, connected "
        "components (streaming, bucket-partitioned)",
        "parameters": {
            k: d[k]
            for k in (
                "threshold",
                "num_perm",
                "shingle_size",
                "seed",
                "bands",
                "rows",
                "recall_target",
                "partitions",
            )
        }
        | {"survivor": "lowest input index in the cluster"},
        "backend": res.executor,
        "shards": len(res.blocks_index.blocks),
        "exact_duplicates": d.get("exact_duplicates", 0),
        "near_duplicates": d.get("near_duplicates", 0),
        "clusters": d.get("clusters", 0),
        "candidate_pairs": d.get("candidate_pairs", 0),
        "verified_pairs": d.get("verified_pairs", 0),
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
