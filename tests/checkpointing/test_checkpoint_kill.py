"""A save killed midway (SIGKILL of the saving process) is never listed.

A real child process saves one complete checkpoint, then starts a second save
that is frozen at a chosen point of the write path (by patching the child's copy
of DCP or ``os.rename``, which only decides *when* the kill lands); the test then
SIGKILLs it. The storage must list only the first checkpoint, which must still
load, and a restarted Checkpointer must sweep the leftovers and save again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from stages.checkpointing import Checkpointer, CheckpointPolicy, list_checkpoints

# How long the child may take to import torch and reach the kill point.
CHILD_READY_TIMEOUT_S = 120.0

CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    from stages.checkpointing import CheckpointPolicy, Checkpointer

    storage, kill_point, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    policy = CheckpointPolicy(storage_uri="file://" + storage, interval_steps=1, keep=3)
    state = {"w": torch.arange(4_000_000, dtype=torch.float32), "step": 1}
    ck = Checkpointer(policy, run_label="victim")
    ck.save(1, state)
    ck.wait()

    def freeze():
        ready.write_text(kill_point)
        time.sleep(600)

    if kill_point == "during_write":      # one item written, file not complete
        original_write = fs._write_item
        def write_then_freeze(*args, **kwargs):
            result = original_write(*args, **kwargs)
            freeze()
        fs._write_item = write_then_freeze
    elif kill_point == "before_metadata":  # every data file written and fsynced
        fs._FileSystemWriter.finish = lambda *a, **k: freeze()
    elif kill_point == "before_rename":    # commit record written, not yet renamed
        original_rename = os.rename
        def rename(src, dst, *a, **k):
            if ".tmp-" in os.fspath(src):
                freeze()
            return original_rename(src, dst, *a, **k)
        os.rename = rename
    state["w"] = state["w"] + 1
    state["step"] = 2
    ck.save(2, state)
    ck.wait()
    print("save completed: the kill point was never reached", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kill_point", ["during_write", "before_metadata", "before_rename"])
def test_save_killed_midway_is_never_listed(tmp_path: Path, kill_point: str) -> None:
    storage = tmp_path / "ckpt"
    ready = tmp_path / "ready"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    child = subprocess.Popen(
        [sys.executable, str(script), str(storage), kill_point, str(ready)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + CHILD_READY_TIMEOUT_S
        while not ready.exists():
            if child.poll() is not None:
                out = child.stdout.read().decode() if child.stdout else ""
                pytest.fail(f"child exited before the kill point:\n{out[-3000:]}")
            assert time.monotonic() < deadline, "child never reached the kill point"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    leftovers = [p.name for p in storage.iterdir() if p.name.startswith(".tmp-victim-")]
    assert leftovers == [".tmp-victim-step_000000002"]
    records = list_checkpoints(storage)
    assert [r.step for r in records] == [1]

    policy = CheckpointPolicy(storage_uri=f"file://{storage}", interval_steps=1, keep=3)
    with Checkpointer(policy, run_label="victim") as ck:  # the restarted run
        assert sorted(p.name for p in storage.iterdir()) == ["step_000000001"]
        latest = ck.latest()
        assert latest is not None and latest.step == 1
        state = {"w": torch.zeros(4_000_000), "step": 0}
        ck.load(latest, state)
        assert torch.equal(state["w"], torch.arange(4_000_000, dtype=torch.float32))
        assert state["step"] == 1
        ck.save(2, state)
        ck.wait()
        assert [r.step for r in ck.records()] == [1, 2]
