"""Both weight paths (object store, collective broadcast) deliver bit-identical weights
to in-process rollout workers; the bucket plan round-trips any state dict.

Real RolloutWorkers on threads and a real gloo process group; the Ray actor version
is in tests/post_training/test_fleet_ray.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.weight_board import sync_only_controller

from stages.post_training.weight_sync import (
    CollectiveWeights,
    pack,
    plan_buckets,
    state_digest,
    unpack,
)


def test_buckets_round_trip_and_respect_the_bucket_size() -> None:
    state = {
        "a": torch.randn(10, 3),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(5),
        "d": torch.randn(40),  # larger than a bucket: one of its own
        "e": torch.randn(2, 2).to(torch.bfloat16),
    }
    tensors, buckets = plan_buckets(state, bucket_bytes=128)
    desc = CollectiveWeights("h", 1, 2, "gloo", 1.0, tensors, buckets)
    for dt, n in buckets:
        size = torch.empty(0, dtype=getattr(torch, dt)).element_size()
        assert n * size <= 128 or n == 40  # only the oversized tensor exceeds it
    assert {dt for dt, _ in buckets} == {"float32", "int64", "bfloat16"}
    out = unpack(pack(state, desc, "cpu"), desc)
    assert state_digest(out) == state_digest(state)
    out["a"][0, 0] += 1  # a digest sees a single changed value
    assert state_digest(out) != state_digest(state)


def _workers(policy: Path, n: int) -> list[Any]:
    from stages.post_training.rollout import RolloutWorker, WorkerSpec

    spec = WorkerSpec(
        index=0,
        model_dir=str(policy),
        reward="first_number_match",
        max_completion_tokens=4,
        overlong_buffer_tokens=2,
        overlong_penalty_factor=0.5,
    )
    return [RolloutWorker(spec.model_copy(update={"index": i})) for i in range(n)]


@pytest.mark.parametrize("path", ["object_store", "collective"])
def test_each_path_delivers_bit_identical_weights_to_thread_workers(
    tiny_policy: Path, path: str
) -> None:
    from stages.post_training.hf_io import load_model
    from stages.post_training.pools import LocalPool

    model = load_model(tiny_policy)
    start = state_digest(dict(model.state_dict()))
    # A small bucket size: the tiny policy goes in several buckets per version.
    pool = LocalPool(_workers(tiny_policy, 2), weight_sync=path, bucket_bytes=16 << 10)  # type: ignore[arg-type]
    ctl = sync_only_controller(pool, 60)
    try:
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))  # as an optimizer step would
            ctl.publish(version, dict(model.state_dict()))
            ctl.drain_syncs(120)
            want = state_digest(dict(model.state_dict()))
            assert want != start
            assert pool.digests(60) == [want, want]
            assert pool.versions(60) == [version, version]
        assert len(ctl.stats.sync_s) == 2 and all(s > 0 for s in ctl.stats.sync_s)
    finally:
        pool.close()


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda", "nccl")])
def test_the_collective_backend_follows_the_device(device: str, backend: str) -> None:
    """Chosen by device; no group is formed here (NCCL itself needs GPUs)."""
    from stages.post_training.weight_sync import CollectiveSender

    sender = CollectiveSender(
        workers=1, host="127.0.0.1", device=device, bucket_bytes=1 << 20, timeout_s=5
    )
    try:
        assert sender.backend == backend
    finally:
        sender.close()
