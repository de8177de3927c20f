"""Data-prep throughput: vectorised dedup vs datasketch used well (``MinHash.bulk`` +
``MinHashLSH``), and decontamination MB/s.

    python benchmarks/data_prep.py [--docs 50000] [--repeat 3] [--baseline-docs 0 (all)]
                                   [--baseline-hashfuncs xxh32,sha1]

Corpus: random 80-word documents with planted near-duplicate copies at Jaccard drawn
from 0.3-0.95 (stages.data_prep.synth). Measured in the same process, ``--repeat``
rounds, each round timing our dedup and then every baseline back to back; rates are
medians over rounds (a burst of load on a shared machine moves one round, not the
median):

- dedup_docs_per_s: the whole ``stages.data_prep.dedup`` pipeline from the texts
  (normalisation, shingling, exact duplicates, MinHash, LSH banding, exact-Jaccard
  verification, union-find), one process;
- baseline_<hashfunc>_docs_per_s: datasketch's fastest documented path on the same
  texts, the same normalisation (``normalize_words``) and the same word 5-shingles:
  ``MinHash.bulk`` (one call for all documents, 128 permutations) with
  ``hashfunc=<hashfunc>``, then ``MinHashLSH(threshold=0.8)`` filled in an
  ``insertion_session`` and queried once per document for candidate pairs. Hash
  functions: ``sha1`` (datasketch's default, ``sha1_hash32``) and ``xxh32``
  (``xxhash.xxh32_intdigest``: datasketch's docs advise a fast non-cryptographic hash
  such as farmhash "for better performance"; xxhash is what is installed here).
  The baseline does less work than ours: no exact-duplicate pass, no verification,
  no clustering, and ``MinHashLSH(threshold=0.8)`` picks b=9 r=13 (fewer, longer
  bands than our b=21 r=6, so fewer inserts and candidates, and lower recall);
- baseline_docs_per_s: the fastest baseline (median over rounds);
- speedup: median dedup_docs_per_s / baseline_docs_per_s; speedup_rounds: the ratio
  of each round (ours / that round's fastest baseline); speedup_<hashfunc>: against
  each baseline;
- precision / recall: pairs in one dedup cluster against every pair with exact shingle
  Jaccard >= 0.8 (computed on word tuples with an inverted index: pairs sharing no
  shingle have Jaccard 0, so this is exact all-pairs); baseline_precision /
  baseline_recall: the fastest baseline's candidate pairs against the same truth;
- decontam_mb_per_s: matching the corpus against GSM8K test (13-grams), MB of text/s;
- loadavg: /proc/loadavg's 1-minute figure before and after the timed rounds.

Prints a few lines, then one JSON line. Timings are wall clock on whatever machine
runs it; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

from datasketch import MinHash, MinHashLSH
from datasketch.hashfunc import sha1_hash32

from stages.data_prep.config import DecontaminationConfig, DedupConfig
from stages.data_prep.decontam import EvalIndex, decontaminate
from stages.data_prep.dedup import dedup
from stages.data_prep.evals import load_eval_items
from stages.data_prep.synth import (
    Pair,
    cluster_pairs,
    planted_pair_corpus,
    precision_recall,
    similar_pairs_exact,
)
from stages.data_prep.text import normalize_words


def _hashfuncs() -> dict[str, Callable[[bytes], int]]:
    funcs: dict[str, Callable[[bytes], int]] = {"sha1": sha1_hash32}
    try:
        import xxhash
    except ImportError:  # not a dependency of ours; the default hash is still measured
        return funcs
    funcs["xxh32"] = xxhash.xxh32_intdigest
    return funcs


def baseline_datasketch(
    texts: list[str],
    num_perm: int,
    k: int,
    threshold: float,
    hashfunc: Callable[[bytes], int] = sha1_hash32,
) -> tuple[float, float, set[Pair]]:
    """(docs/s of MinHash.bulk + MinHashLSH insert and query, docs/s of the bulk
    sketching alone, candidate pairs) over word k-shingles."""
    t0 = time.perf_counter()
    shingles = []
    for text in texts:
        words = normalize_words(text)
        shingles.append(
            [" ".join(words[i : i + k]).encode("utf-8") for i in range(max(len(words) - k + 1, 1))]
        )
    sketches = MinHash.bulk(shingles, num_perm=num_perm, hashfunc=hashfunc)
    t_sketch = time.perf_counter() - t0
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    with lsh.insertion_session() as session:
        for i, m in enumerate(sketches):
            session.insert(i, m)
    candidates: set[Pair] = set()
    for i, m in enumerate(sketches):
        candidates.update((i, j) for j in lsh.query(m) if j > i)
    elapsed = time.perf_counter() - t0
    return len(texts) / elapsed, len(texts) / t_sketch, candidates


def _loadavg() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=50_000)
    p.add_argument("--pair-fraction", type=float, default=0.1)
    p.add_argument("--baseline-docs", type=int, default=0, help="0: all documents")
    p.add_argument("--repeat", type=int, default=3, help="rounds of ours + every baseline")
    p.add_argument(
        "--baseline-hashfuncs",
        default="xxh32,sha1",
        help="comma-separated: xxh32 (xxhash.xxh32_intdigest), sha1 (datasketch's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = DedupConfig(threshold=0.8, num_perm=128, shingle_size=5)
    available = _hashfuncs()
    names = [n for n in args.baseline_hashfuncs.split(",") if n]
    missing = [n for n in names if n not in available]
    if missing or not names:
        p.error(f"baseline hash functions {missing or names} not available: {sorted(available)}")

    pairs = int(args.docs * args.pair_fraction)
    texts, _ = planted_pair_corpus(args.docs - pairs, pairs, seed=args.seed)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"corpus: {len(texts)} docs, {pairs} planted copies, {mb:.1f} MB", file=sys.stderr)
    base_texts = texts[: args.baseline_docs] if args.baseline_docs else texts

    load_before = _loadavg()
    ours: list[float] = []
    base: dict[str, list[float]] = {n: [] for n in names}
    sketch_rate: dict[str, list[float]] = {n: [] for n in names}
    rounds: list[float] = []
    base_cands: dict[str, set[Pair]] = {}
    for r in range(args.repeat):
        t0 = time.perf_counter()
        result = dedup(texts, cfg, use_ray=False)
        ours.append(len(texts) / (time.perf_counter() - t0))
        for n in names:
            rate, srate, base_cands[n] = baseline_datasketch(
                base_texts, cfg.num_perm, cfg.shingle_size, cfg.threshold, available[n]
            )
            base[n].append(rate)
            sketch_rate[n].append(srate)
        rounds.append(ours[-1] / max(base[n][-1] for n in names))
        print(
            f"round {r + 1}: dedup {ours[-1]:.0f} docs/s; "
            + "; ".join(f"datasketch/{n} {base[n][-1]:.0f} docs/s" for n in names)
            + f"; ratio {rounds[-1]:.2f} (load {_loadavg():.2f})",
            file=sys.stderr,
        )
    load_after = _loadavg()
    dedup_rate = statistics.median(ours)
    base_median = {n: statistics.median(v) for n, v in base.items()}
    fastest = max(base_median, key=lambda n: base_median[n])
    print(
        f"dedup: {dedup_rate:.0f} docs/s (median of {args.repeat}), b={result.bands} "
        f"r={result.rows}, {result.candidate_pairs} candidates, "
        f"{len(result.verified_pairs)} verified",
        file=sys.stderr,
    )
    for n in names:
        print(
            f"baseline datasketch MinHash.bulk(hashfunc={n}) + MinHashLSH: "
            f"{base_median[n]:.0f} docs/s (sketching alone "
            f"{statistics.median(sketch_rate[n]):.0f} docs/s; {len(base_texts)} docs)",
            file=sys.stderr,
        )

    truth = similar_pairs_exact(texts, cfg.shingle_size, cfg.threshold)
    precision, recall = precision_recall(cluster_pairs(result.clusters), truth)
    base_truth = {pr for pr in truth if pr[1] < len(base_texts)}
    base_precision, base_recall = precision_recall(base_cands[fastest], base_truth)
    print(
        f"pairs >= 0.8: {len(truth)}; precision {precision:.4f} recall {recall:.4f}; "
        f"datasketch/{fastest}'s {len(base_cands[fastest])} candidates: "
        f"precision {base_precision:.4f} "
        f"recall {base_recall:.4f}",
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
                "repeat": args.repeat,
                "dedup_docs_per_s": round(dedup_rate, 1),
                "baseline": fastest,
                "baseline_docs_per_s": round(base_median[fastest], 1),
                **{f"baseline_{n}_docs_per_s": round(base_median[n], 1) for n in names},
                **{
                    f"baseline_{n}_sketch_docs_per_s": round(statistics.median(sketch_rate[n]), 1)
                    for n in names
                },
                "baseline_docs": len(base_texts),
                "speedup": round(dedup_rate / base_median[fastest], 2),
                "speedup_rounds": [round(x, 2) for x in rounds],
                **{f"speedup_{n}": round(dedup_rate / base_median[n], 2) for n in names},
                "precision": round(precision, 4),
                "recall": round(recall, 4),
                "baseline_precision": round(base_precision, 4),
                "baseline_recall": round(base_recall, 4),
                "decontam_mb_per_s": round(decontam_rate, 2),
                "loadavg": [round(load_before, 2), round(load_after, 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
