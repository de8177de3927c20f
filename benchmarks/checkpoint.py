"""Checkpoint benchmark (CI: smallest size only): async vs sync DCP save, and disk bandwidth.

Builds a training-like state of ``--state-mb`` MB (fp32 weights plus two AdamW
moments, in tensors of ``--tensor-mb``). After one warm-up async save (which
allocates the cached CPU staging buffers), it runs ``--repeats`` interleaved
rounds in one folder, so load from other processes hits all three alike:

1. raw disk: the same bytes (the tensors' own) written sequentially to one
   file in ``DISK_CHUNK`` writes, then fsync;
2. sync save: ``torch.distributed.checkpoint.save`` with fsync (what a training
   loop blocks for without async checkpointing);
3. async saves: ``stages.checkpointing.Checkpointer`` (``dcp.async_save``, cached
   CPU staging buffers, commit on completion) in both staging modes, as a loop
   does it: ``save()``, then ``--step-s`` of main-thread compute (the next
   step's forward/backward), then ``optimizer.step()``, then the weights change.
   Blocking = time in ``save()`` + time ``optimizer.step()`` waited for the copy
   (``inline``: all of the copy is in ``save()``; ``background``: only what the
   compute did not cover). Staged = until the copy was done; bandwidth = bytes /
   (start of the save to commit, fsyncs included).

Medians over the rounds are reported, and how much slower the compute ran right
after ``save()`` than idle (staging and writing share the 2 cores and the GIL).

    .venv/bin/python benchmarks/checkpoint.py --state-mb 1024

The last line is one JSON object: state_mb, sync_save_s, async_block_s,
block_ratio, ckpt_mb_per_s, disk_mb_per_s, bandwidth_ratio (plus details).
Every Checkpointer save is sealed (``stages/checkpointing/seal.py``: BLAKE3 of every
file as it is written, an HMAC over them and the run's binding), with a throwaway key.
Goals: block_ratio <= 0.005, bandwidth_ratio >= 0.7. Timings on a shared machine are
noisy: run it when the machine is quiet (note ``uptime``), and compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.checkpointing import Checkpointer, CheckpointPolicy

MB = 1 << 20
DISK_CHUNK = 8 * MB
# "background" (the Checkpointer default): the copy runs on a staging thread, save()
# returns at once, and the next optimizer.step() waits for it. "inline": save()
# copies the state into cached CPU buffers before it returns.
MODES = ("background", "inline")


def build_state(state_mb: int, tensor_mb: int) -> dict[str, dict[str, torch.Tensor]]:
    """Weights plus two AdamW moments, a third of the bytes each, all non-zero (zero
    pages can be written faster than data by some virtual disks)."""
    per_group = state_mb * MB // 3
    n = max(1, per_group // (tensor_mb * MB))
    numel = per_group // n // 4
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(numel, generator=gen) for i in range(n)}
    optim = {}
    for i in range(n):
        optim[f"state.layers.{i}.weight.exp_avg"] = torch.randn(numel, generator=gen) * 1e-3
        optim[f"state.layers.{i}.weight.exp_avg_sq"] = torch.rand(numel, generator=gen) * 1e-6
    return {"model": model, "optim": optim}


def state_bytes(state: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for d in state.values() for t in d.values())


def disk_write(path: Path, state: dict[str, dict[str, torch.Tensor]]) -> float:
    """Seconds to write the state's own bytes sequentially to one file and fsync."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for group in state.values():
            for t in group.values():
                view = t.numpy().data.cast("B")
                for off in range(0, len(view), DISK_CHUNK):
                    chunk = view[off : off + DISK_CHUNK]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def sync_save(state: dict[str, dict[str, torch.Tensor]], folder: Path) -> float:
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(folder, sync_files=True), no_dist=True)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(folder)
    return elapsed


def compute_rate(seconds: float) -> float:
    """Matmuls per second on the main thread (a stand-in for training compute)."""
    a = torch.randn(256, 256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
        n += 1
    return n / (time.perf_counter() - t0)


def async_round(
    ck: Checkpointer,
    step: int,
    state: dict[str, dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    step_s: float,
) -> dict[str, float]:
    """One async save as a training loop does it: save, the next step's forward and
    backward (``step_s`` of main-thread compute), then ``optimizer.step()``, which
    waits for a background copy still running. Blocking = save() + that wait."""
    t0 = time.perf_counter()
    ck.save(step, state, guard=optimizer)
    block = time.perf_counter() - t0
    busy = compute_rate(step_s) if step_s > 0 else 0.0
    t1 = time.perf_counter()
    optimizer.step()
    block += time.perf_counter() - t1
    for t in state["model"].values():  # the optimizer moved the weights
        t.add_(1.0)
    record = ck.wait()
    assert record is not None
    return {
        "block": block,
        "staged": record.staged_s,
        "total": record.total_s,
        "mb_per_s": record.bytes_per_s / MB,
        "bytes": record.bytes,
        "busy": busy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--state-mb", type=int, default=1024, help="state size in MB (default 1024)")
    ap.add_argument("--tensor-mb", type=int, default=32, help="size of each tensor in MB")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved rounds of raw write, sync save, async saves",
    )
    ap.add_argument(
        "--staging",
        choices=MODES,
        default="background",
        help="which async mode the headline figures report (both are measured)",
    )
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="folder on the disk to measure (default: a temp folder)",
    )
    ap.add_argument(
        "--step-s",
        type=float,
        default=0.5,
        help="forward/backward time between save() and optimizer.step() "
        "(main-thread compute; 0 = step right after save)",
    )
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        state = build_state(args.state_mb, args.tensor_mb)
        nbytes = state_bytes(state)
        state_mb = nbytes / MB
        print(
            f"state: {state_mb:.0f} MB in "
            f"{sum(len(d) for d in state.values())} tensors; folder {root}",
            flush=True,
        )
        idle = compute_rate(args.step_s) if args.step_s > 0 else 0.0
        # The loop's optimizer: its step() is where a background copy is waited for.
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)

        checkpointers = {
            mode: Checkpointer(
                CheckpointPolicy(storage_uri=f"file://{root / mode}", interval_steps=1, keep=1),
                run_label=f"bench-{mode}",
                async_staging=mode == "background",
                # A throwaway key: the benchmark needs no launch key file.
                seal_key=secrets.token_bytes(32),
            )
            for mode in MODES
        }
        disk_s: list[float] = []
        sync_s: list[float] = []
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        try:
            first = {
                mode: async_round(ck, 0, state, optimizer, args.step_s)
                for mode, ck in checkpointers.items()
            }
            for mode, r in first.items():
                print(
                    f"warm-up {mode} async save (allocates staging buffers): blocking "
                    f"{r['block']:.3f} s, staged {r['staged']:.3f} s",
                    flush=True,
                )
            # Interleaved rounds, so load from other processes hits every measurement
            # alike; medians are reported.
            for i in range(1, args.repeats + 1):
                disk_s.append(disk_write(root / "raw.bin", state))
                sync_s.append(sync_save(state, root / "sync"))
                line = (
                    f"round {i}: raw disk {disk_s[-1]:.2f} s "
                    f"({state_mb / disk_s[-1]:.0f} MB/s) | sync save {sync_s[-1]:.2f} s"
                )
                for mode, ck in checkpointers.items():
                    r = async_round(ck, i, state, optimizer, args.step_s)
                    rounds[mode].append(r)
                    line += (
                        f" | {mode}: blocking {r['block']:.3f} s, staged {r['staged']:.3f} s"
                        f", total {r['total']:.2f} s ({r['mb_per_s']:.0f} MB/s)"
                    )
                print(line, flush=True)
        finally:
            for ck in checkpointers.values():
                ck.close()

        def med(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in rounds[mode])

        slowdown = None
        if args.step_s > 0:
            busy = statistics.median(r["busy"] for m in MODES for r in rounds[m])
            slowdown = round(idle / busy, 2)
            print(
                f"compute: {idle:.0f} matmuls/s idle, {busy:.0f} right after save() "
                f"({slowdown}x slower while staging/writing)",
                flush=True,
            )

        mode = args.staging
        async_block_s = med(mode, "block")
        disk_mb_per_s = state_mb / statistics.median(disk_s)
        sync_save_s = statistics.median(sync_s)
        ckpt_mb_per_s = med(mode, "mb_per_s")
        result = {
            "state_mb": round(state_mb, 1),
            "sync_save_s": round(sync_save_s, 3),
            "async_block_s": round(async_block_s, 4),
            "block_ratio": round(async_block_s / sync_save_s, 4),
            "ckpt_mb_per_s": round(ckpt_mb_per_s, 1),
            "disk_mb_per_s": round(disk_mb_per_s, 1),
            "bandwidth_ratio": round(ckpt_mb_per_s / disk_mb_per_s, 3),
            "staging": mode,
            "staged_s": round(med(mode, "staged"), 4),
            "async_total_s": round(med(mode, "total"), 3),
            "first_save_block_s": round(first[mode]["block"], 3),
            "first_save_staged_s": round(first[mode]["staged"], 3),
            **{f"{m}_block_s": round(med(m, "block"), 4) for m in MODES},
            **{f"{m}_mb_per_s": round(med(m, "mb_per_s"), 1) for m in MODES},
            "checkpoint_bytes": int(rounds[mode][-1]["bytes"]),
            "disk_runs_s": [round(x, 3) for x in disk_s],
            "sync_runs_s": [round(x, 3) for x in sync_s],
            "step_s": args.step_s,
            "compute_slowdown": slowdown,
        }
        print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
