"""Live resize benchmark (CI: smallest size only): a run grows by a replica group and
shrinks back without a restart; Ray Train V2's elastic resize beside it.

1. Ours: the real training stage (a local Ray, torchft lighthouse, one Ray actor per
   replica group, gloo on cpu) with ``--groups`` groups of ``--preset``, the production
   recovery configuration (``production_recovery`` of a booking of ``--groups`` nodes,
   one group each: its warm standbys and FT timeouts; ``--spares`` overrides) and, on
   cpu, each group pinned to its share of the cores (``replica.group_cores``: beyond
   the core count, round robin). After ``--warmup-steps`` the booking grows by one
   node: a ``ResizeRequest`` for ``--groups + 1`` groups goes into the run's inbox, as
   the orchestrator's supervisor delivers it; later it shrinks back (the added group
   leaves). Measured:

   - ``grow_s`` / ``shrink_s``: the run's own ``ResizeEvent`` (``applied``) seconds, from
     the booking change (``requested_at``, taken right before the inbox put) to the
     first committed step with the new group count. The new group is an idle warm
     standby promoted to it (its replacement starts in the background) or, with none
     warm, a new process that builds its model; it heals from a live peer (no
     checkpoint read) and joins at a step every group held at (``grow_path``:
     ``standby`` or ``launched``); a leaving group is drained at a step boundary. On a real
     cluster the supervisor's delivery comes first: it checks the booking every
     ``SupervisorSettings.resize_check_interval_s`` (1 s), plus one call to the driver.
   - ``tokens_per_s_before`` / ``_after_grow`` / ``_after_shrink``: a committed step's
     tokens (its whole global batch: the batch stays fixed and is re-cut over the
     members) over the median gap between consecutive commits of group 0 in a window
     of ``--measure-steps`` steps (a checkpoint's or a load spike's stall does not move
     it): before the grow, the steps after the standbys are warm (their warm-up shares
     the cores); after a resize, from ``--settle-steps`` after its applied step on.
     ``grow_ready_s``: from the booking change to the new group in the quorum
     (``groups_added``: every group held, the new group activated or started and
     built, in the quorum).

2. Ray Train V2's elastic mode (``ScalingConfig(num_workers=(groups, groups + 1))``,
   ``FailureConfig(max_failures=...)``) with ``benchmarks/ray_train_baseline.py``'s
   training function: the same model, global batch, sequence length and optimizer,
   DDP, a checkpoint reported every ``--checkpoint-every`` steps (Ray Train resizes by
   restarting the worker group from its newest checkpoint), each worker pinned to a
   core as the groups are (rank r on core r mod cores). A node is a node: a local
   multi-node cluster (``ray.cluster_utils.Cluster``: a head for the driver and the
   Train controller, and one raylet per worker slot, each carrying one unit of a
   custom resource every worker requires), started with ``--groups`` slot nodes. The
   controller checks for a resize every ``--monitor-interval-s`` seconds
   (``elastic_resize_monitor_interval_s``; its default is 60 s, 1 s is its fastest
   useful setting: its policy re-reads its resource reservation at most once a second).
   After the first checkpoint and ``--warmup-steps``:

   - grow: a slot node joins (``Cluster.add_node``); ``ray_train_grow_s`` counts from
     the node registered with the GCS (its raylet's start is left out, in Ray Train's
     favour) to the first step trained by a worker group of ``groups + 1``;
     ``ray_train_grow_back_s`` to that group's first step beyond the step reached
     before (the steps since the checkpoint are redone first).
   - shrink: the added node is removed (``Cluster.remove_node``, as a host taken
     back): for Ray Train a worker failure. ``ray_train_shrink_s`` / ``_back_s`` count
     from the removal's start the same way.
   - tokens/s before and after each, from worker rank 0's step log, as for ours
     (before: the steps after the first checkpoint);
     ``ray_train_{grow,shrink}_started_s``: to the new worker group's training
     function started.

   Ray Train learns of nodes through Ray Data's ``AutoscalingCoordinator`` actor,
   whose view of the cluster is refreshed on its own 20 s tick
   (``_AutoscalingCoordinatorActor.TICK_INTERVAL_S``, not configurable), so its
   reaction to an added node is that tick's phase plus the monitor interval plus a
   worker-group restart. After a removed node's worker failed, the restart may still
   count the node: it asks for the larger group, waits out its worker-group start
   timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s) and then retries smaller.

Prints one line per measurement, a table of both sides, and ends with one JSON line
(``grow_ratio`` / ``shrink_ratio``: Ray Train's seconds to the first step with the new
size over ours). Goal: ours <= 5 s and >= 3x faster than Ray Train's. Timings on a
shared, loaded machine are noisy (the load average is printed before and after).

    .venv/bin/python benchmarks/elastic.py --groups 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks import fault_tolerance as ft_bench
from benchmarks import ray_train_baseline
from benchmarks.ray_join import add_ray_address, init_ray
from stages.checkpointing.config import DEFAULT_INTERVAL_STEPS
from stages.events import Event, FleetEvent, LogEvent, ResizeEvent, StepEvent
from stages.resize import ResizeRequest
from stages.trainer.fleet.recovery import production_recovery

# Steps of the starting group count before the grow (the last --measure-steps time it).
WARMUP_STEPS = 30
# Steps timed for each tokens/s figure.
MEASURE_STEPS = 20
# Steps after an applied resize before its tokens/s window starts.
SETTLE_STEPS = 5
# Ray Train's resize check (``elastic_resize_monitor_interval_s``, default 60 s): as
# often as its policy re-reads its resource reservation (once a second).
MONITOR_INTERVAL_S = 1.0
# Ray Train retries its worker group this many times: a removed node is a failure,
# and a restart may find the coordinator's stale view of the cluster (a placement
# that cannot be met until its next tick) and fail again.
RAY_TRAIN_MAX_FAILURES = 10
# The custom resource one slot node carries and every Ray Train worker requires.
SLOT_RESOURCE = "elastic_bench_slot"
# Ray's "latest cluster" file, which ``Cluster`` rewrites; put back as it was.
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--groups", type=int, default=2, help="replica groups (nodes) at the start")
    p.add_argument("--preset", default="llama-tiny", help="configs/models preset")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--spares",
        type=int,
        default=None,
        help="warm standbys of our run (default: what production launches for a "
        "booking of --groups nodes)",
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=3072,
        help="global batch tokens (its sequences split over --groups and --groups + 1)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=DEFAULT_INTERVAL_STEPS,
        help="steps between saves, both sides (default: the production default)",
    )
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS)
    p.add_argument("--measure-steps", type=int, default=MEASURE_STEPS)
    p.add_argument("--settle-steps", type=int, default=SETTLE_STEPS)
    p.add_argument(
        "--monitor-interval-s",
        type=float,
        default=MONITOR_INTERVAL_S,
        help="Ray Train's elastic_resize_monitor_interval_s",
    )
    p.add_argument(
        "--ray-train",
        type=int,
        choices=[0, 1],
        default=1,
        help="1: measure Ray Train V2's elastic resize too (0: ours only)",
    )
    p.add_argument("--num-cpus", type=int, default=4, help="Ray logical CPUs (ours)")
    add_ray_address(p)
    args = p.parse_args(argv)
    if args.groups < 1:
        p.error("--groups must be >= 1")
    sequences = args.batch_tokens // args.seq_len
    if args.batch_tokens % args.seq_len or sequences % args.groups or sequences % (args.groups + 1):
        p.error(
            f"--batch-tokens must be whole sequences of --seq-len that split over "
            f"{args.groups} and {args.groups + 1} groups"
        )
    if args.warmup_steps < 1 or args.measure_steps < 1 or args.settle_steps < 0:
        p.error("--warmup-steps and --measure-steps must be >= 1, --settle-steps >= 0")
    if args.spares is None:
        args.spares = production_recovery({"node_count": args.groups}).spare_groups
    # What fault_tolerance.stage_config reads.
    args.ranks_per_group = 1
    args.heartbeat_ms = None
    return args


# --- ours --------------------------------------------------------------------------------
def group0_steps(w: ft_bench.Watcher) -> dict[int, StepEvent]:
    """Group 0's committed steps by number (a redone step's last report)."""
    return {e.step: e for e in sorted(w.steps(), key=lambda e: e.ts) if e.replica_group == 0}


def median_gap(at: dict[int, float], first: int, last: int) -> float:
    """The median time between consecutive steps ``first`` .. ``last`` (a checkpoint's
    or a load spike's stall does not move it)."""
    return statistics.median(
        at[s] - at[s - 1] for s in range(first + 1, last + 1) if s in at and s - 1 in at
    )


def ours_rate(w: ft_bench.Watcher, first: int, last: int) -> float:
    """Tokens/s over group 0's committed steps ``first`` .. ``last``: a step's tokens
    (its whole global batch) over the median gap between their commits."""
    steps = group0_steps(w)
    tokens = statistics.median(steps[s].tokens for s in range(first + 1, last + 1))
    return tokens / median_gap({s: e.ts for s, e in steps.items()}, first, last)


def is_fleet(e: Event, action: str) -> bool:
    return isinstance(e, FleetEvent) and e.action == action


def wait_group0(w: ft_bench.Watcher, step: int) -> StepEvent:
    return w.wait(lambda e: e.replica_group == 0 and e.step >= step, f"group 0 at step {step}")


def resize(sess: ft_bench.Session, request_id: str, groups: int) -> tuple[ResizeEvent, float]:
    """The booking's new size into the run's inbox; the run's applied event and the
    booking change's time."""
    t = time.time()
    sess.ctx.resize_inbox.put(
        ResizeRequest(
            request_id=request_id,
            replica_groups=groups,
            requested_at=t,
            reason="benchmark: the booking changed",
        )
    )

    def answered(e: Event) -> bool:
        return (
            isinstance(e, ResizeEvent)
            and e.request_id == request_id
            and e.action in ("applied", "refused")
        )

    done = sess.w.wait_event(answered, f"resize {request_id}")
    assert isinstance(done, ResizeEvent)
    if done.action != "applied":
        raise RuntimeError(f"resize {request_id} refused: {done.reason}")
    return done, t


def measure_ours(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import ray

    from orchestrator.runtime.launch import use_scratch_launch_key

    data = ft_bench.write_train_data(tmp)
    cfg = ft_bench.stage_config(args, spares=args.spares, ckpt_root=tmp / "ckpt-ours", data=data)
    use_scratch_launch_key(tmp)  # run by hand, no server holds one
    init_ray(args.ray_address, tmp / "ray", args.num_cpus)
    out: dict[str, Any] = {}
    m, settle = args.measure_steps, args.settle_steps
    try:
        with ft_bench.Session(cfg, tmp, f"elb{os.getpid()}") as sess:
            w = sess.w
            wait_group0(w, args.warmup_steps)

            # The standbys' warm-up shares the cores: the rate before is timed after it.
            def all_warm(_: Event) -> bool:
                return sum(is_fleet(x, "standby_warm") for x in w.events) >= args.spares

            if args.spares:
                w.wait_event(all_warm, "the standbys warm")
            wait_group0(w, max(group0_steps(w)) + m)
            now = max(group0_steps(w))
            out["tokens_per_s_before"] = ours_rate(w, now - m, now)
            print(
                f"ours, {args.groups} groups: {out['tokens_per_s_before']:.0f} tokens/s", flush=True
            )
            for name, groups in (("grow", args.groups + 1), ("shrink", args.groups)):
                done, t_change = resize(sess, f"{name}{os.getpid()}", groups)
                assert done.step is not None and done.seconds is not None
                wait_group0(w, done.step + settle + m)
                rate = ours_rate(w, done.step + settle, done.step + settle + m)
                out[f"{name}_s"] = done.seconds
                if name == "grow":  # the new group built, every group held at one step
                    added = next(e for e in w.events if is_fleet(e, "groups_added"))
                    out["grow_ready_s"] = added.ts - t_change
                    promoted = any(
                        isinstance(e, FleetEvent)
                        and e.action == "standby_activated"
                        and e.replica_group == args.groups
                        for e in w.events
                    )
                    out["grow_path"] = "standby" if promoted else "launched"
                out[f"{name}_step"] = done.step
                out[f"tokens_per_s_after_{name}"] = rate
                ready = (
                    f" (new group, {out['grow_path']}, in the quorum after "
                    f"{out['grow_ready_s']:.2f}s)"
                )
                print(
                    f"ours {name} {done.groups_before} -> {done.groups_after}: first step "
                    f"with {groups} groups (step {done.step}) {done.seconds:.2f}s after the "
                    f"booking change{ready if name == 'grow' else ''}; then {rate:.0f} tokens/s",
                    flush=True,
                )
                # Where the seconds went: the resizer's milestones, each from the change.
                for e in w.events:
                    if isinstance(e, LogEvent) and e.message.startswith(
                        f"resize {done.request_id}:"
                    ):
                        print(f"  {e.message}", flush=True)
    finally:
        ray.shutdown()
    return out


# --- Ray Train V2 elastic ------------------------------------------------------------------
def sized_rate(rows: list[tuple[int, float, int]], first: int, last: int, batch: int) -> float:
    """Tokens/s of rank 0's steps ``first`` .. ``last`` (rows of one worker group): the
    global batch over the median gap between them."""
    return batch / median_gap({step: ts for step, ts, _ in rows}, first, last)


class RayTrainResize:
    """One Ray Train run on a local multi-node cluster, its step log read back."""

    def __init__(self, run: ray_train_baseline.Run, batch_tokens: int):
        self.run = run
        self.batch = batch_tokens

    def wait(self, pred: Any, what: str) -> tuple[int, float, int]:
        deadline = time.time() + ray_train_baseline.STEP_TIMEOUT_S
        while time.time() < deadline:
            for row in self.run.log.sized_rows():
                if pred(row):
                    return row
            if self.run.errors:
                raise RuntimeError(f"ray train ended: {self.run.errors[0]!r}"[:300])
            time.sleep(ray_train_baseline.POLL_S)
        raise TimeoutError(f"ray train: no {what} within {ray_train_baseline.STEP_TIMEOUT_S:.0f}s")

    def resized(self, t: float, world: int, settle: int, measure: int) -> dict[str, float]:
        """The first step of a ``world``-worker group after ``t``, the first beyond the
        step reached at ``t``, and the tokens/s ``settle`` steps on."""
        reached = max((s for s, ts, _ in self.run.log.sized_rows() if ts <= t), default=0)
        first = self.wait(lambda r: r[1] > t and r[2] == world, f"a step with {world} workers")
        back = self.wait(
            lambda r: r[1] > t and r[2] == world and r[0] > reached, "the step reached before"
        )
        start = first[0] + settle
        self.wait(lambda r: r[1] > first[1] and r[0] >= start + measure, "measured steps")
        rows = [r for r in self.run.log.sized_rows() if r[1] >= first[1] and r[2] == world]
        starts = (self.run.logs / "starts.log").read_text().split()
        return {
            "s": first[1] - t,
            "started_s": min((float(x) for x in starts if float(x) > t), default=first[1]) - t,
            "back_s": back[1] - t,
            "redone": max(0, reached - first[0] + 1),
            "rate": sized_rate(rows, start, start + measure, self.batch),
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def restore_address_file(before: str | None, ours: str) -> None:
    """Put Ray's "latest cluster" file back unless someone else wrote it since."""
    try:
        if RAY_ADDRESS_FILE.read_text() != ours:
            return
        if before is None:
            RAY_ADDRESS_FILE.unlink()
        else:
            RAY_ADDRESS_FILE.write_text(before)
    except OSError:
        pass


def measure_ray_train(args: argparse.Namespace, tmp: Path, lr: float) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.train.v2.api.config import ScalingConfig  # V2 (what ray.train exports)

    before_file = RAY_ADDRESS_FILE.read_text() if RAY_ADDRESS_FILE.exists() else None
    before_env = os.environ.get("RAY_ADDRESS")
    # Ray Train's helpers that find "the" cluster by themselves (its placement-group
    # cleaner) must find this one, not another Ray on the machine: its address fixed
    # in advance, in every node's environment.
    port = free_port()
    address = f"{ray.util.get_node_ip_address()}:{port}"
    os.environ["RAY_ADDRESS"] = address
    node_args: dict[str, Any] = {"num_cpus": 1, "resources": {SLOT_RESOURCE: 1}}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "temp_dir": str(tmp / "rc"),
            "gcs_server_port": port,
        },
    )
    out: dict[str, Any] = {}
    m, settle = args.measure_steps, args.settle_steps
    run: ray_train_baseline.Run | None = None
    try:
        for _ in range(args.groups):
            cluster.add_node(**node_args)
        ray.init(address=cluster.address, log_to_driver=False)
        run = ray_train_baseline.Run.start(
            preset=args.preset,
            workers=args.groups,
            seq_len=args.seq_len,
            batch_tokens=args.batch_tokens,
            lr=lr,
            checkpoint_every=args.checkpoint_every,
            max_failures=RAY_TRAIN_MAX_FAILURES,
            device=args.device,
            scaling=ScalingConfig(
                num_workers=(args.groups, args.groups + 1),
                use_gpu=args.device == "cuda",
                resources_per_worker={"CPU": 1, SLOT_RESOURCE: 1},
                elastic_resize_monitor_interval_s=args.monitor_interval_s,
            ),
        )
        rt = RayTrainResize(run, args.batch_tokens)
        # A checkpoint to resume from before the node comes (the rate timed after it).
        ready = max(args.warmup_steps, args.checkpoint_every + 1) + m
        top = rt.wait(lambda r: r[0] >= ready and r[2] == args.groups, f"step {ready}")[0]
        out["ray_train_tokens_per_s_before"] = sized_rate(
            run.log.sized_rows(), top - m, top, args.batch_tokens
        )
        print(
            f"ray train, {args.groups} workers: "
            f"{out['ray_train_tokens_per_s_before']:.0f} tokens/s",
            flush=True,
        )
        t0 = time.time()
        added = cluster.add_node(**node_args)
        t_change = time.time()  # the node is registered with the GCS
        out["ray_train_node_start_s"] = t_change - t0
        for name, world in (("grow", args.groups + 1), ("shrink", args.groups)):
            if name == "shrink":
                t_change = time.time()
                cluster.remove_node(added)
            r = rt.resized(t_change, world, settle, m)
            out[f"ray_train_{name}_s"] = r["s"]
            out[f"ray_train_{name}_started_s"] = r["started_s"]
            out[f"ray_train_{name}_back_s"] = r["back_s"]
            out[f"ray_train_{name}_redone_steps"] = r["redone"]
            out[f"ray_train_tokens_per_s_after_{name}"] = r["rate"]
            print(
                f"ray train {name} -> {world} workers: training function started after "
                f"{r['started_s']:.2f}s, first step with {world} workers "
                f"{r['s']:.2f}s after the node {'joined' if name == 'grow' else 'went'}, "
                f"the step reached before after {r['back_s']:.2f}s ({r['redone']:.0f} steps "
                f"redone); then {r['rate']:.0f} tokens/s",
                flush=True,
            )
    finally:
        if run is not None:
            run.stop()
            if run.errors:
                out["ray_train_error"] = repr(run.errors[0])[:300]
        ray.shutdown()
        cluster.shutdown()
        restore_address_file(before_file, address)
        if before_env is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before_env
    return out


# --- both ------------------------------------------------------------------------------------
def table(args: argparse.Namespace, s: dict[str, Any]) -> str:
    def f(key: str, fmt: str) -> str:
        v = s.get(key)
        return format(v, fmt) if isinstance(v, int | float) else "-"

    g = args.groups
    rows = [
        ("", "ours (torchft, live)", "Ray Train V2 elastic"),
        (f"grow {g}->{g + 1}: s to first step", f("grow_s", ".2f"), f("ray_train_grow_s", ".2f")),
        ("  s to new progress", f("grow_s", ".2f"), f("ray_train_grow_back_s", ".2f")),
        (
            f"shrink {g + 1}->{g}: s to first step",
            f("shrink_s", ".2f"),
            f("ray_train_shrink_s", ".2f"),
        ),
        ("  s to new progress", f("shrink_s", ".2f"), f("ray_train_shrink_back_s", ".2f")),
        (
            f"tokens/s, {g} before",
            f("tokens_per_s_before", ".0f"),
            f("ray_train_tokens_per_s_before", ".0f"),
        ),
        (
            f"tokens/s, {g + 1} after grow",
            f("tokens_per_s_after_grow", ".0f"),
            f("ray_train_tokens_per_s_after_grow", ".0f"),
        ),
        (
            f"tokens/s, {g} after shrink",
            f("tokens_per_s_after_shrink", ".0f"),
            f("ray_train_tokens_per_s_after_shrink", ".0f"),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="ito-elastic-"))
    results: dict[str, Any] = {}
    try:
        results.update(measure_ours(args, tmp))
        if args.ray_train:
            data = tmp / "train.jsonl"
            lr = ft_bench.stage_config(
                args, spares=0, ckpt_root=tmp / "ckpt-rt", data=data
            ).target.learning_rate
            results.update(measure_ray_train(args, tmp, lr))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(side: str) -> float | None:
        ours, theirs = results.get(f"{side}_s"), results.get(f"ray_train_{side}_s")
        return round(theirs / ours, 2) if ours and theirs is not None else None

    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}
    summary: dict[str, Any] = {
        **rounded,
        "grow_ratio": ratio("grow"),
        "shrink_ratio": ratio("shrink"),
        "groups": args.groups,
        "spares": args.spares,
        "preset": args.preset,
        "device": args.device,
        "seq_len": args.seq_len,
        "batch_tokens": args.batch_tokens,
        "checkpoint_every": args.checkpoint_every,
        "monitor_interval_s": args.monitor_interval_s,
        "wall_s": round(time.time() - t_start, 1),
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }
    print(table(args, summary), flush=True)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
