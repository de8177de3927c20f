"""Sharded dedup on a real local Ray cluster gives the same answer as one process."""

from __future__ import annotations

import numpy as np
import pytest

from stages.data_prep.config import DedupConfig
from stages.data_prep.dedup import dedup
from stages.data_prep.synth import planted_pair_corpus


@pytest.mark.slow
def test_dedup_sharded_over_ray_workers_matches_local(ray_local: None) -> None:
    texts, _ = planted_pair_corpus(200, 150, seed=5)
    texts += texts[:7]  # exact duplicates across shards
    cfg = DedupConfig(ray_min_docs=100, shard_docs=90)  # threshold lowered for the test
    sharded = dedup(texts, cfg)  # use_ray=None: Ray is up and the input is "large"
    local = dedup(texts, cfg, use_ray=False)
    assert sharded.backend == "ray" and sharded.shards == 4
    assert local.backend == "local" and local.shards == 1
    assert sharded.clusters == local.clusters and sharded.near_duplicates > 0
    assert sharded.exact_duplicates == local.exact_duplicates == 7
    np.testing.assert_array_equal(sharded.keep, local.keep)
