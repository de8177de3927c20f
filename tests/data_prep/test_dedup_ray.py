"""Sharded dedup on a real local Ray cluster gives the same answer as one process."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from stages.data_prep.config import DedupConfig
from stages.data_prep.dedup import dedup
from stages.data_prep.synth import planted_pair_corpus


@pytest.fixture
def local_ray() -> Iterator[None]:
    import ray

    # A short temp dir of our own: Ray's socket paths must stay under 107 bytes.
    temp = tempfile.mkdtemp(prefix="dpray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_dedup_sharded_over_ray_workers_matches_local(local_ray: None) -> None:
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
