"""Both weight paths (object store, collective) deliver bit-identical weights to
in-process rollout workers; the bucket plan round-trips any state dict; the collective
path's listener gives nothing to a process without the run's secret.

Real RolloutWorkers on threads and real sockets; the Ray actor version is in
tests/post_training/test_fleet_ray.py. A sender killed mid-version is a real process
(tests/helpers/collective_sender.py) and a real SIGKILL; the stranger is a real
process (tests/helpers/weight_sync_intruder.py) with no secret."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.backend import free_port
from helpers.weight_board import sync_only_controller

from stages.netsec import NONCE_BYTES, RunSecret
from stages.post_training.weight_descriptors import (
    CollectiveWeights,
    pack,
    plan_buckets,
    state_digest,
    unpack,
)
from stages.post_training.weight_sync import CollectiveSender, sync_key

REPO = Path(__file__).resolve().parents[2]
# A hang guard on a sender process's exit, never a speed claim.
SENDER_EXIT_TIMEOUT_S = 60.0
# Hang guards on the stranger's process (each of its attempts is bounded) and on a
# version's delivery on a loaded 2-core host.
INTRUDER_TIMEOUT_S = 180.0
SYNC_TIMEOUT_S = 60.0
KEY = sync_key(RunSecret.new())
HELPERS_ENV = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}


def test_buckets_round_trip_and_respect_the_bucket_size() -> None:
    state = {
        "a": torch.randn(10, 3),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(5),
        "d": torch.randn(40),  # larger than a bucket: one of its own
        "e": torch.randn(2, 2).to(torch.bfloat16),
    }
    tensors, buckets = plan_buckets(state, bucket_bytes=128)
    desc = CollectiveWeights("h", 1, 2, b"t" * 16, 1.0, 1.0, tensors, buckets)
    for dt, n in buckets:
        size = torch.empty(0, dtype=getattr(torch, dt)).element_size()
        assert n * size <= 128 or n == 40  # only the oversized tensor exceeds it
    assert {dt for dt, _ in buckets} == {"float32", "int64", "bfloat16"}
    out = unpack(pack(state, desc, "cpu"), desc)
    assert state_digest(out) == state_digest(state)
    out["a"][0, 0] += 1  # a digest sees a single changed value
    assert state_digest(out) != state_digest(state)


def _workers(policy: Path, n: int, key: bytes | None = KEY) -> list[Any]:
    from stages.post_training.rollout import RolloutWorker, WorkerSpec

    spec = WorkerSpec(
        index=0,
        model_dir=str(policy),
        reward="first_number_match",
        max_completion_tokens=4,
        overlong_buffer_tokens=2,
        overlong_penalty_factor=0.5,
    )
    return [RolloutWorker(spec.model_copy(update={"index": i}), key) for i in range(n)]


@pytest.mark.parametrize("path", ["object_store", "collective"])
def test_each_path_delivers_bit_identical_weights_to_thread_workers(
    tiny_policy: Path, path: str
) -> None:
    from stages.post_training.hf_io import load_model
    from stages.post_training.pools import LocalPool

    model = load_model(tiny_policy)
    start = state_digest(dict(model.state_dict()))
    # A small bucket size: the tiny policy goes in several buckets per version.
    pool = LocalPool(
        _workers(tiny_policy, 2),
        weight_sync=path,  # type: ignore[arg-type]
        bucket_bytes=16 << 10,
        sync_key=KEY,
    )
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


def _start_dying_sender(policy: Path, seed: int, die_after: int) -> tuple[Any, Any, str]:
    """A learner's rank 0 in its own process (``helpers.collective_sender``) that
    SIGKILLs itself after ``die_after`` buckets: (its process, the version's
    descriptor, the digest of the state it sends)."""
    args = [sys.executable, "-m", "helpers.collective_sender", "--policy", str(policy)]
    args += ["--seed", str(seed), "--die-after", str(die_after)]
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env=HELPERS_ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(KEY.hex() + "\n")  # the test's stand-in for Ray's actor argument
    proc.stdin.flush()
    desc, digest = pickle.loads(base64.b64decode(proc.stdout.readline()))
    return proc, desc, digest


def _perturbed_state(policy: Path, seed: int) -> dict[str, Any]:
    from stages.post_training.hf_io import load_model

    torch.manual_seed(seed)
    model = load_model(policy)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return dict(model.state_dict())


def test_a_sender_killed_mid_broadcast_leaves_the_worker_at_its_version_until_a_new_one(
    tiny_policy: Path,
) -> None:
    """The collective path's sender (the learner's rank 0, a process of its own) is
    SIGKILLed after the first bucket of version 2: the worker's receive fails within
    its timeout instead of hanging, the worker keeps version 1's weights and reports
    version 2 missed; then a new sender (a healed rank 0, a new listener) delivers
    version 3 bit-identical. Versions 1 and 3 come from senders in this process (only
    the killed one needs a process of its own)."""
    (worker,) = _workers(tiny_policy, 1)

    def digest() -> str:
        return state_digest(dict(worker.model.state_dict()))

    def deliver(version: int, seed: int) -> None:
        state = _perturbed_state(tiny_policy, seed)
        sender = CollectiveSender(
            workers=1, key=KEY, device="cpu", bucket_bytes=16 << 10, timeout_s=SYNC_TIMEOUT_S
        )
        try:
            reply = worker.set_weights(version, sender.put(state))
            assert reply["version"] == version and "missed" not in reply, reply
            assert digest() == state_digest(state)
            sender.flush(SYNC_TIMEOUT_S)
        finally:
            sender.close()

    deliver(1, seed=1)
    want = digest()

    dying, desc, _ = _start_dying_sender(tiny_policy, seed=2, die_after=1)
    assert len(desc.buckets) > 1  # the death falls between two buckets
    reply = worker.set_weights(2, desc)
    dying.wait(timeout=SENDER_EXIT_TIMEOUT_S)
    assert dying.returncode == -signal.SIGKILL
    assert reply["version"] == 1 and reply["missed"] == 2, reply
    assert reply["error"]
    assert worker.version == 1 and digest() == want  # nothing of version 2 was loaded

    deliver(3, seed=3)


def test_a_stranger_process_gets_no_weights_and_the_worker_gets_them_exactly(
    tiny_policy: Path,
) -> None:
    """A foreign process on the network (its own process, the version's descriptor in
    hand, no secret) tries a raw connection, a handshake with a key of its own, and the
    TCPStore + gloo join that took the weights from the earlier rendezvous: it reads
    no byte past the listener's challenge and rebuilds no weights. The real worker,
    which proves the run's key, then gets the exact version."""
    state = _perturbed_state(tiny_policy, seed=7)
    sender = CollectiveSender(
        workers=1, key=KEY, device="cpu", bucket_bytes=16 << 10, timeout_s=SYNC_TIMEOUT_S
    )
    try:
        desc = sender.put(state)  # queued: it goes out once the worker is in
        intruder = subprocess.run(
            [sys.executable, "-m", "helpers.weight_sync_intruder"],
            cwd=REPO,
            env=HELPERS_ENV,
            input=base64.b64encode(pickle.dumps(desc)).decode() + "\n",
            capture_output=True,
            text=True,
            timeout=INTRUDER_TIMEOUT_S,
        )
        assert intruder.returncode == 0, intruder.stderr[-2000:]
        report = json.loads(intruder.stdout.strip().splitlines()[-1])
        assert report["weights_digest"] is None, report
        assert report["max_bytes_read"] <= NONCE_BYTES, report  # the challenge, no more
        assert report["attempts"]["wrong_key"].startswith("refused"), report
        assert sender.refused >= 3 and sender.proven() == [], report

        # Strangers that connect and say nothing hold no one up while the worker joins.
        silent = [socket.create_connection((desc.host, desc.port)) for _ in range(3)]
        (worker,) = _workers(tiny_policy, 1)
        reply = worker.set_weights(1, desc)
        assert reply["version"] == 1 and "missed" not in reply, reply
        assert state_digest(dict(worker.model.state_dict())) == state_digest(state)
        sender.flush(SYNC_TIMEOUT_S)
        for conn in silent:
            conn.close()
    finally:
        sender.close()


def test_a_worker_of_another_run_is_refused_and_a_fake_sender_gets_no_worker(
    tiny_policy: Path,
) -> None:
    """Both directions of the proof: a worker holding another run's key gets no frame
    (it misses the version, keeps none of it); a listener that poses as the sender
    without the key is refused by the worker before it reads a byte of weights."""
    state = _perturbed_state(tiny_policy, seed=8)
    sender = CollectiveSender(
        workers=1, key=KEY, device="cpu", bucket_bytes=16 << 10, timeout_s=SYNC_TIMEOUT_S
    )
    try:
        desc = sender.put(state)
        (other_run,) = _workers(tiny_policy, 1, key=sync_key(RunSecret.new()))
        reply = other_run.set_weights(1, desc)
        assert reply["version"] == -1 and reply["missed"] == 1, reply
        assert "PeerRefused" in reply["error"], reply
        assert sender.proven() == [] and sender.refused == 1
    finally:
        sender.close()

    # A fake sender: it answers the worker's connection with a challenge and then
    # offers a version's frame, with no proof of the key in between.
    fake = socket.create_server(("127.0.0.1", 0))
    offered: list[int] = []

    def pose() -> None:
        conn, _ = fake.accept()
        with conn:
            conn.sendall(os.urandom(NONCE_BYTES))
            conn.recv(1 << 10)  # the worker's proof
            conn.sendall(os.urandom(32))  # not the server's proof
            try:
                conn.sendall(b"\0" * desc.bytes)
                offered.append(desc.bytes)
            except OSError:
                pass

    t = threading.Thread(target=pose, daemon=True)
    t.start()
    (worker,) = _workers(tiny_policy, 1)
    base = state_digest(dict(worker.model.state_dict()))
    forged = CollectiveWeights(
        "127.0.0.1",
        fake.getsockname()[1],
        2,
        desc.tag,
        SYNC_TIMEOUT_S,
        SYNC_TIMEOUT_S,
        desc.tensors,
        desc.buckets,
    )
    reply = worker.set_weights(1, forged)
    t.join(SYNC_TIMEOUT_S)
    fake.close()
    assert reply["version"] == -1 and reply["missed"] == 1, reply
    assert "did not prove" in reply["error"], reply
    assert state_digest(dict(worker.model.state_dict())) == base


def test_the_listener_binds_the_cluster_address_on_a_port_of_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never a wildcard: the node's cluster address (``ITO_NODE_IP`` here, as the
    deployment sets it), on a port of ``ITO_LISTEN_PORTS``."""
    first = free_port()
    monkeypatch.setenv("ITO_NODE_IP", "127.0.0.1")
    monkeypatch.setenv("ITO_LISTEN_PORTS", f"{first}-{first + 3}")
    sender = CollectiveSender(
        workers=1, key=KEY, device="cpu", bucket_bytes=1 << 20, timeout_s=SYNC_TIMEOUT_S
    )
    try:
        desc = sender.describe({"w": torch.zeros(3)})
        assert (desc.host, desc.port) == ("127.0.0.1", sender.port)
        assert first <= desc.port <= first + 3
        assert sender._listener.getsockname()[0] == "127.0.0.1"
    finally:
        sender.close()
