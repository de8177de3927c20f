"""Both weight paths (object store, collective broadcast) deliver bit-identical weights
to in-process rollout workers; the bucket plan round-trips any state dict.

Real RolloutWorkers on threads and a real gloo process group; the Ray actor version
is in tests/post_training/test_fleet_ray.py. A sender killed mid-broadcast is a real
process (tests/helpers/collective_sender.py) and a real SIGKILL."""

from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import sys
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

REPO = Path(__file__).resolve().parents[2]
# A hang guard on a sender process's exit, never a speed claim.
SENDER_EXIT_TIMEOUT_S = 60.0


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


def _start_sender(policy: Path, seed: int, die_after: int | None = None) -> tuple[Any, Any, str]:
    """A learner's rank 0 in its own process (``helpers.collective_sender``): (its
    process, the version's descriptor, the digest of the state it sends)."""
    args = [sys.executable, "-m", "helpers.collective_sender", "--policy", str(policy)]
    args += ["--seed", str(seed)]
    if die_after is not None:
        args += ["--die-after", str(die_after)]
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    desc, digest = pickle.loads(base64.b64decode(proc.stdout.readline()))
    return proc, desc, digest


def test_a_sender_killed_mid_broadcast_leaves_the_worker_at_its_version_until_a_new_one(
    tiny_policy: Path,
) -> None:
    """The collective path's sender (the learner's rank 0) is SIGKILLed after the first
    bucket of version 2: the worker's receive fails within its timeout instead of
    hanging, the worker keeps version 1's weights and reports version 2 missed; then a
    new sender (a healed rank 0, a new rendezvous) delivers version 3 bit-identical."""
    from stages.post_training.weight_sync import state_digest

    (worker,) = _workers(tiny_policy, 1)

    def digest() -> str:
        return state_digest(dict(worker.model.state_dict()))

    first, desc, want = _start_sender(tiny_policy, seed=1)
    try:
        reply = worker.set_weights(1, desc)
        assert reply["version"] == 1 and "missed" not in reply, reply
        assert digest() == want
    finally:
        first.communicate("done\n", timeout=SENDER_EXIT_TIMEOUT_S)

    dying, desc, _ = _start_sender(tiny_policy, seed=2, die_after=1)
    assert len(desc.buckets) > 1  # the death falls between two buckets
    reply = worker.set_weights(2, desc)
    dying.wait(timeout=SENDER_EXIT_TIMEOUT_S)
    assert dying.returncode == -signal.SIGKILL
    assert reply["version"] == 1 and reply["missed"] == 2, reply
    assert reply["error"]
    assert worker.version == 1 and digest() == want  # nothing of version 2 was loaded

    healed, desc, want = _start_sender(tiny_policy, seed=3)
    try:
        assert worker.set_weights(3, desc)["version"] == 3
        assert digest() == want
    finally:
        healed.communicate("done\n", timeout=SENDER_EXIT_TIMEOUT_S)
