"""Data prep at corpus scale: streaming dedup on Ray Data, docs/s and peak memory as the
corpus grows 16x, against the in-memory dedup measured the same way.

    python benchmarks/data_prep_scale.py [--sizes 100000,400000,1600000]
        [--baseline-sizes 100000,400000] [--block-docs 20000] [--cpus 2] [--dir DIR]
        [--results FILE]   # append each size's line to FILE and summarise all of FILE

Corpus (generated, one jsonl per size, ``{"id", "text"}``): random 80-word documents
over a 30k-word vocabulary; in every window of 10,000 documents 5% are edited copies
of an earlier document of the window (1-6 words replaced by words no original uses:
Jaccard of 5-word shingles from ~0.6 to ~0.9, so both sides of the 0.8 threshold)
and 1% exact copies.

What each number counts:
- ``docs_per_s``: input documents / wall seconds of ``run_stream`` (index, sketch,
  exact, candidates, fetch, verify, components, filter, publish), the Ray cluster
  already started (its start-up, ~8 s, is not counted), in a fresh process per size;
- ``peak_rss_mb``: the largest sum, sampled every 0.25 s, of the resident memory of
  the driver process and of every Ray worker process (``ray::*``); Ray's own daemons
  (raylet, GCS, ~550 MB) are not counted, nor is shared memory counted once;
- ``rss_growth``: peak_rss_mb at the largest size / at the smallest;
- ``precision``, ``recall``: documents dropped by dedup in the first 10,000 documents
  of the largest corpus against exact ground truth: every pair with word 5-shingle
  Jaccard >= 0.8 found with an inverted index (``synth.similar_pairs_exact``),
  clustered, all but the lowest member of each cluster counted as duplicates;
- ``baseline``: the in-memory ``stages.data_prep.dedup`` (the whole corpus read into
  one process, Ray off) at ``--baseline-sizes``, docs/s and peak RSS the same way;
  ``baseline_rss_growth`` is its peak at its largest size over its smallest (for
  ``baseline_docs_growth`` times the documents).

Ends with one JSON line: ``docs``, ``docs_per_s``, ``peak_rss_mb`` (lists, one per
size), ``rss_growth``, ``precision``, ``recall``, and the baseline's lists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from stages.atomic_write import open_atomic

WINDOW = 10_000
WORDS = 80
VOCAB = 30_000
SAMPLE = 10_000
REPO = Path(__file__).resolve().parents[1]


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(VOCAB)], dtype=object)
    fresh = 0
    with open_atomic(path, "w") as f:  # a later run reuses it: whole or absent
        for start in range(0, n, WINDOW):
            m = min(WINDOW, n - start)
            words = vocab[rng.integers(0, VOCAB, (m, WORDS))]
            kind = rng.random(m)
            for d in range(1, m):
                if kind[d] < 0.06:  # 1% exact, 5% edited copies of an earlier doc
                    words[d] = words[rng.integers(0, d)]
                    if kind[d] >= 0.01:
                        edits = int(rng.integers(1, 7))
                        pos = rng.choice(WORDS, edits, replace=False)
                        words[d, pos] = [f"x{fresh + e}" for e in range(edits)]
                        fresh += edits
            for d in range(m):
                f.write(json.dumps({"id": start + d, "text": " ".join(words[d])}) + "\n")


class RssMonitor:
    """Peak of (driver RSS + Ray workers' RSS), sampled."""

    def __init__(self, interval_s: float = 0.25):
        import psutil

        self.psutil, self.interval, self.peak = psutil, interval_s, 0
        self.me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        total = self.me.memory_info().rss
        for p in self.me.children(recursive=True):
            try:
                if p.name().startswith("ray::") or "default_worker.py" in " ".join(p.cmdline()):
                    total += p.memory_info().rss
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


def child(args: argparse.Namespace) -> None:
    from stages.data_prep.config import DedupConfig

    corpus, out = Path(args.corpus), Path(args.out)
    if args.child == "baseline":
        from stages.data_prep.dedup import dedup
        from stages.data_prep.records import read_input

        with RssMonitor() as mon:
            t0 = time.perf_counter()
            texts = read_input(corpus).texts
            res = dedup(texts, DedupConfig(), use_ray=False)
            seconds = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "docs": len(texts),
                    "seconds": seconds,
                    "peak_rss_mb": mon.peak / 2**20,
                    "docs_out": int(res.keep.sum()),
                }
            )
        )
        return
    import ray

    from benchmarks.ray_join import init_ray
    from stages.data_prep.stream import RayDataExecutor, StreamConfig, input_files, run_stream
    from stages.data_prep.stream.output import spilling_config

    temp = tempfile.mkdtemp(prefix="dpscale")
    cfg = StreamConfig(block_docs=args.block_docs)
    # A Ray of its own, in a fresh process per size: its workers' memory is counted.
    init_ray(
        None,
        Path(temp),
        args.cpus,
        object_store_memory=cfg.object_store_memory_mb * 2**20,
        _system_config={"object_spilling_config": spilling_config(temp + "/spill")},
    )
    try:
        files = [(p, r, f, 0, "custom") for p, r, f in input_files(corpus)]
        with RssMonitor() as mon:
            t0 = time.perf_counter()
            streamed = run_stream(
                files,
                out,
                dedup_cfg=DedupConfig(),
                cfg=cfg,
                executor=RayDataExecutor(cfg),
                work_dir=Path(args.work),
            )
            seconds = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "docs": streamed.counts["docs_in"],
                    "seconds": seconds,
                    "peak_rss_mb": mon.peak / 2**20,
                    "docs_out": streamed.counts["docs_out"],
                    "stage_seconds": streamed.stage_seconds,
                }
            )
        )
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def run_child(mode: str, corpus: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--work",
        str(out) + ".work",
        "--block-docs",
        str(args.block_docs),
        "--cpus",
        str(args.cpus),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


def precision_recall_sample(corpus: Path, out: Path) -> tuple[float, float]:
    from stages.data_prep.stream.tasks import connected_components
    from stages.data_prep.synth import similar_pairs_exact

    texts = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == SAMPLE:
                break
    pairs = np.array(sorted(similar_pairs_exact(texts, 5, 0.8)), dtype=np.int64).reshape(-1, 2)
    nodes, root = connected_components(pairs[:, 0], pairs[:, 1])
    truth = set(nodes[nodes != root].tolist())
    kept: set[int] = set()
    for shard in sorted(out.glob("part-*.jsonl")):
        with open(shard, encoding="utf-8") as f:
            for line in f:
                i = json.loads(line)["id"]
                if i < SAMPLE:
                    kept.add(i)
    dropped = set(range(SAMPLE)) - kept
    tp = len(dropped & truth)
    return (tp / len(dropped) if dropped else 1.0), (tp / len(truth) if truth else 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000,400000,1600000")
    p.add_argument("--baseline-sizes", default="100000,400000")
    p.add_argument("--block-docs", type=int, default=20_000)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--dir", default=None, help="corpora and outputs (default: a temp dir)")
    p.add_argument("--results", default=None)
    p.add_argument("--child", default=None)
    p.add_argument("--corpus")
    p.add_argument("--out")
    p.add_argument("--work")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dpscale"))
    base.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    sizes = [int(s) for s in args.sizes.split(",") if s]
    baseline_sizes = [int(s) for s in args.baseline_sizes.split(",") if s]
    for n in sorted(set(sizes) | set(baseline_sizes)):
        corpus = base / f"corpus-{n}.jsonl"
        if not corpus.exists():
            t0 = time.time()
            write_corpus(corpus, n)
            print(
                f"generated {n} docs, {corpus.stat().st_size / 2**20:.0f} MB "
                f"in {time.time() - t0:.0f} s",
                flush=True,
            )
        for mode in (["ray"] if n in sizes else []) + (["baseline"] if n in baseline_sizes else []):
            out = base / f"out-{mode}-{n}"
            shutil.rmtree(out, ignore_errors=True)
            r = run_child(mode, corpus, out, args)
            row = {
                "mode": mode,
                "docs": r["docs"],
                "docs_per_s": r["docs"] / r["seconds"],
                "peak_rss_mb": r["peak_rss_mb"],
                "docs_out": r["docs_out"],
                "corpus_mb": corpus.stat().st_size / 2**20,
            }
            if mode == "ray" and n == max(sizes):
                row["precision"], row["recall"] = precision_recall_sample(corpus, out)
            print(
                f"{mode:8s} {r['docs']:>9d} docs ({row['corpus_mb']:.0f} MB): "
                f"{row['docs_per_s']:8.0f} docs/s, peak RSS {row['peak_rss_mb']:7.0f} MB, "
                f"{r['docs_out']} kept  {r.get('stage_seconds', '')}",
                flush=True,
            )
            rows.append(row)
            if mode == "ray":
                shutil.rmtree(out, ignore_errors=True)
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if args.results:
        rows = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x]
    ray_rows = sorted((r for r in rows if r["mode"] == "ray"), key=lambda r: r["docs"])
    bl = sorted((r for r in rows if r["mode"] == "baseline"), key=lambda r: r["docs"])
    top = ray_rows[-1] if ray_rows else {}
    summary = {
        "docs": [r["docs"] for r in ray_rows],
        "docs_per_s": [round(r["docs_per_s"], 1) for r in ray_rows],
        "peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in ray_rows],
        "rss_growth": round(ray_rows[-1]["peak_rss_mb"] / ray_rows[0]["peak_rss_mb"], 3)
        if ray_rows
        else None,
        "precision": round(top["precision"], 4) if "precision" in top else None,
        "recall": round(top["recall"], 4) if "recall" in top else None,
        "baseline_docs": [r["docs"] for r in bl],
        "baseline_docs_per_s": [round(r["docs_per_s"], 1) for r in bl],
        "baseline_peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in bl],
        # Growth of the in-memory baseline over its own sizes, for comparison.
        "baseline_rss_growth": round(bl[-1]["peak_rss_mb"] / bl[0]["peak_rss_mb"], 3)
        if bl
        else None,
        "baseline_docs_growth": round(bl[-1]["docs"] / bl[0]["docs"], 3) if bl else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
