"""Streaming dedup on a real local Ray cluster (Ray Data): the same survivors, byte for
byte, as in one process, and planted near-duplicates found with precision and recall
>= 0.95 against exact ground truth."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.data_prep.config import DedupConfig
from stages.data_prep.stream import RayDataExecutor, StreamConfig, input_files, run_stream
from stages.data_prep.stream.tasks import connected_components
from stages.data_prep.synth import planted_pair_corpus, similar_pairs_exact

pytestmark = pytest.mark.slow


def test_ray_data_gives_the_same_output_as_one_process(tmp_path: Path, ray_local: None) -> None:
    texts, _ = planted_pair_corpus(3000, 1000, seed=7)
    texts += texts[100:130]
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)),
        encoding="utf-8",
    )
    files = [(p, r, f, 0, "custom") for p, r, f in input_files(src)]
    cfg = StreamConfig(block_docs=450, min_partitions=3)
    on_ray = run_stream(
        files, tmp_path / "ray", dedup_cfg=DedupConfig(), cfg=cfg, executor=RayDataExecutor(cfg)
    )
    local = run_stream(files, tmp_path / "local", dedup_cfg=DedupConfig(), cfg=cfg)
    assert on_ray.executor == "ray" and local.executor == "local"
    assert len(on_ray.blocks_index.blocks) == -(-len(texts) // 450) == 9
    assert on_ray.attempt == local.attempt
    assert [s["sha256"] for s in on_ray.shards] == [s["sha256"] for s in local.shards]
    assert on_ray.counts == local.counts and on_ray.dedup == local.dedup
    assert on_ray.counts["exact_duplicates"] == 30

    # Precision and recall of the dropped documents against exact ground truth: every
    # pair with word 5-shingle Jaccard >= 0.8, clustered; all but the lowest member of
    # a cluster are duplicates.
    truth_pairs = np.array(sorted(similar_pairs_exact(texts, 5, 0.8)), dtype=np.int64)
    nodes, root = connected_components(truth_pairs[:, 0], truth_pairs[:, 1])
    truth = set(nodes[nodes != root].tolist())
    kept = {
        json.loads(x)["id"]
        for s in on_ray.shards
        for x in (tmp_path / "ray" / s["path"]).read_text("utf-8").splitlines()
    }
    dropped = set(range(len(texts))) - kept
    tp = len(dropped & truth)
    assert len(truth) > 200
    assert tp / len(dropped) >= 0.95 and tp / len(truth) >= 0.95
