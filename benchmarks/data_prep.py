"""Data-prep throughput: vectorised dedup vs datasketch used well (``MinHash.bulk`` +
``MinHashLSH``), and decontamination MB/s.

    python benchmarks/data_prep.py [--docs 50000] [--baseline-docs 0 (all)]

Corpus: random 80-word documents with planted near-duplicate copies at Jaccard drawn
from 0.3-0.95 (stages.data_prep.synth). Measured in the same process:

- dedup_docs_per_s: the whole ``stages.data_prep.dedup`` pipeline (exact hash,
  vectorised MinHash, LSH banding, exact-Jaccard verification, union-find), one process;
- baseline_docs_per_s: datasketch's fastest documented path on the same documents and
  the same word 5-shingles: ``MinHash.bulk`` (one call for all documents, 128
  permutations), then ``MinHashLSH(threshold=0.8)`` built in an ``insertion_session``
  and queried once per document (candidate pairs, no exact-Jaccard verification, so
  the baseline does less work than ours); shingling is timed on both sides;
- baseline_sketch_docs_per_s: the ``MinHash.bulk`` part alone;
- speedup: dedup_docs_per_s / baseline_docs_per_s, whatever it is;
- precision / recall: pairs in one dedup cluster against every pair with exact shingle
  Jaccard >= 0.8 (computed on word tuples with an inverted index: pairs sharing no
  shingle have Jaccard 0, so this is exact all-pairs);
- decontam_mb_per_s: matching the corpus against GSM8K test (13-grams), MB of text/s.

Prints a few lines, then one JSON line. Timings are wall clock on whatever machine
runs it; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from datasketch import MinHash, MinHashLSH

from stages.data_prep.config import DecontaminationConfig, DedupConfig
from stages.data_prep.decontam import EvalIndex, decontaminate
from stages.data_prep.dedup import dedup
from stages.data_prep.evals import load_eval_items
from stages.data_prep.synth import (
    cluster_pairs,
    planted_pair_corpus,
    precision_recall,
    similar_pairs_exact,
)
from stages.data_prep.text import normalize_words


def baseline_datasketch(
    texts: list[str], num_perm: int, k: int, threshold: float
) -> tuple[float, float, int]:
    """(docs/s of MinHash.bulk + MinHashLSH insert and query, docs/s of the bulk
    sketching alone, candidate pairs) over word k-shingles."""
    t0 = time.perf_counter()
    shingles = []
    for text in texts:
        words = normalize_words(text)
        shingles.append(
            [" ".join(words[i : i + k]).encode("utf-8") for i in range(max(len(words) - k + 1, 1))]
        )
    sketches = MinHash.bulk(shingles, num_perm=num_perm)
    t_sketch = time.perf_counter() - t0
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    with lsh.insertion_session() as session:
        for i, m in enumerate(sketches):
            session.insert(i, m)
    candidates = 0
    for i, m in enumerate(sketches):
        candidates += sum(1 for j in lsh.query(m) if j > i)
    elapsed = time.perf_counter() - t0
    return len(texts) / elapsed, len(texts) / t_sketch, candidates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=50_000)
    p.add_argument("--pair-fraction", type=float, default=0.1)
    p.add_argument("--baseline-docs", type=int, default=0, help="0: all documents")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = DedupConfig(threshold=0.8, num_perm=128, shingle_size=5)

    pairs = int(args.docs * args.pair_fraction)
    texts, _ = planted_pair_corpus(args.docs - pairs, pairs, seed=args.seed)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"corpus: {len(texts)} docs, {pairs} planted copies, {mb:.1f} MB", file=sys.stderr)

    t0 = time.perf_counter()
    result = dedup(texts, cfg, use_ray=False)
    dedup_rate = len(texts) / (time.perf_counter() - t0)
    print(
        f"dedup: {dedup_rate:.0f} docs/s, b={result.bands} r={result.rows}, "
        f"{result.candidate_pairs} candidates, {len(result.verified_pairs)} verified",
        file=sys.stderr,
    )

    truth = similar_pairs_exact(texts, cfg.shingle_size, cfg.threshold)
    precision, recall = precision_recall(cluster_pairs(result.clusters), truth)
    print(
        f"pairs >= 0.8: {len(truth)}; precision {precision:.4f} recall {recall:.4f}",
        file=sys.stderr,
    )

    base_texts = texts[: args.baseline_docs] if args.baseline_docs else texts
    base_rate, sketch_rate, base_cands = baseline_datasketch(
        base_texts, cfg.num_perm, cfg.shingle_size, cfg.threshold
    )
    print(
        f"baseline datasketch MinHash.bulk + MinHashLSH: {base_rate:.0f} docs/s "
        f"(sketching alone {sketch_rate:.0f} docs/s; {len(base_texts)} docs, "
        f"{base_cands} candidates)",
        file=sys.stderr,
    )

    items, _ = load_eval_items(["gsm8k"])
    t0 = time.perf_counter()
    index = EvalIndex(items, DecontaminationConfig())
    dres = decontaminate(texts, index)
    decontam_rate = mb / (time.perf_counter() - t0)
    print(
        f"decontamination: {decontam_rate:.1f} MB/s ({dres.num_contaminated} flagged)",
        file=sys.stderr,
    )

    print(
        json.dumps(
            {
                "docs": len(texts),
                "dedup_docs_per_s": round(dedup_rate, 1),
                "baseline_docs_per_s": round(base_rate, 1),
                "baseline_sketch_docs_per_s": round(sketch_rate, 1),
                "baseline_docs": len(base_texts),
                "speedup": round(dedup_rate / base_rate, 2),
                "precision": round(precision, 4),
                "recall": round(recall, 4),
                "decontam_mb_per_s": round(decontam_rate, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
