"""Quorum stability under full CPU load (CI: smallest size only): spurious quorum changes per run.

Trains the real training stage (local Ray, torchft lighthouse, ``--groups`` replica
groups) for ``--duration`` seconds per heartbeat setting (after ``--settle-s`` of
loaded training that is not counted) while one busy-loop process per core keeps
every core saturated, and kills nothing. Any step a group
takes in a quorum smaller than all groups, and any uncommitted step, is spurious:
the lighthouse dropped a live group because its heartbeats arrived late.

    .venv/bin/python benchmarks/quorum_stability.py --heartbeat-ms 500,1000 --duration 60

Prints one line per setting and ends with one JSON line: per heartbeat timeout the
steps, spurious quorum shrinks, uncommitted steps and the load average. The
defaults of ``FaultToleranceConfig`` are chosen from this (and from the detect
time of benchmarks/fault_tolerance.py). Other engineers' jobs add to the load.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.ray_join import add_ray_address, init_ray
from stages.base import StageContext
from stages.checkpointing.config import CheckpointPolicy
from stages.events import Event, StepEvent
from stages.trainer.config import (
    FaultToleranceConfig,
    ModelSpec,
    TrainingTarget,
    TrainStageConfig,
)

# Seconds of training before counting starts (start-up and the first quorum).
SETTLE_S = 5.0
# Give up if the run has not reached its first full-quorum step by then.
START_TIMEOUT_S = 180.0


def burn(until: float) -> None:
    x = 0
    while time.time() < until:
        x += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--heartbeat-ms",
        default="500,1000",
        help="comma-separated lighthouse heartbeat timeouts to try",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds counted per setting")
    p.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help="seconds of loaded training after the first full quorum before counting starts",
    )
    p.add_argument("--groups", type=int, default=2)
    p.add_argument(
        "--burners",
        type=int,
        default=os.cpu_count() or 2,
        help="busy-loop processes (default: one per core)",
    )
    p.add_argument("--preset", default="llama-tiny")
    add_ray_address(p)
    return p.parse_args(argv)


def one_setting(hb_ms: int, args: argparse.Namespace, tmp: Path, data: Path) -> dict[str, Any]:
    from stages.trainer import TrainingStage

    base = FaultToleranceConfig()
    ft = base.model_copy(
        update={
            "heartbeat_timeout_ms": hb_ms,
            "heartbeat_interval_ms": min(base.heartbeat_interval_ms, hb_ms // 2),
        }
    )
    FaultToleranceConfig.model_validate(ft.model_dump())  # the same checks as a manifest
    run_id = f"qs{hb_ms}-{os.getpid()}"
    cfg = TrainStageConfig.model_validate(
        dict(
            model=ModelSpec(preset=args.preset, size="bench"),
            target=TrainingTarget(max_steps=1_000_000, seq_len=64, global_batch_tokens=1024),
            checkpoint=CheckpointPolicy(
                interval_steps=1_000_000, storage_uri=f"file://{tmp}/ckpt-{hb_ms}"
            ),
            loss_spike={"enabled": False},
            fault_tolerance=ft.model_dump(),
            replica_groups=args.groups,
            train_files=[str(data)],
        ),
        strict=False,
    )
    events: list[Event] = []
    first_full = threading.Event()

    def emit(e: Event) -> None:
        events.append(e)
        if isinstance(e, StepEvent) and e.committed and e.quorum_size == args.groups:
            first_full.set()

    workdir = tmp / run_id
    workdir.mkdir()
    ctx = StageContext(run_id=run_id, booking_id="bench", workdir=workdir, emit=emit)
    th = threading.Thread(target=lambda: TrainingStage(cfg).run(ctx), daemon=True)
    th.start()
    burners: list[mp.Process] = []
    try:
        if not first_full.wait(START_TIMEOUT_S):
            raise TimeoutError("the run never reached a full quorum")
        t0 = time.time() + args.settle_s
        t1 = t0 + args.duration
        burners = [mp.Process(target=burn, args=(t1,), daemon=True) for _ in range(args.burners)]
        for b in burners:
            b.start()
        time.sleep(max(0.0, t1 - time.time()))
        load = os.getloadavg()[0]
    finally:
        for b in burners:
            b.join(timeout=5)
        ctx.cancel_event.set()
        th.join(timeout=60)
    steps = sorted(
        (e for e in events if isinstance(e, StepEvent) and t0 <= e.ts <= t1),
        key=lambda e: (e.replica_group, e.ts),
    )
    shrinks = 0
    prev: dict[int, int] = {}
    for e in steps:
        if e.quorum_size < args.groups and prev.get(e.replica_group, args.groups) == args.groups:
            shrinks += 1
        prev[e.replica_group] = e.quorum_size
    return {
        "heartbeat_ms": hb_ms,
        "seconds": args.duration,
        "steps": sum(1 for e in steps if e.committed and e.replica_group == 0),
        "spurious_quorum_changes": shrinks,
        "uncommitted_steps": sum(1 for e in steps if not e.committed),
        "load_avg_1m": round(load, 2),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import ray

    from orchestrator.runtime.launch import use_scratch_launch_key

    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ito-qstab-"))
    data = tmp / "train.jsonl"
    with data.open("w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"doc {i}: " + "lorem ipsum " * (i % 11 + 1)}) + "\n")
    use_scratch_launch_key(tmp)  # run by hand, no server holds one
    init_ray(args.ray_address, tmp / "ray", num_cpus=4)
    results = []
    try:
        for hb in (int(x) for x in args.heartbeat_ms.split(",") if x.strip()):
            r = one_setting(hb, args, tmp, data)
            results.append(r)
            print(
                f"heartbeat {hb} ms: {r['steps']} steps in {r['seconds']:.0f}s under "
                f"{args.burners} burners (load {r['load_avg_1m']}): "
                f"{r['spurious_quorum_changes']} spurious quorum changes, "
                f"{r['uncommitted_steps']} uncommitted steps",
                flush=True,
            )
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        json.dumps({"burners": args.burners, "groups": args.groups, "results": results}), flush=True
    )
    return results


if __name__ == "__main__":
    main()
