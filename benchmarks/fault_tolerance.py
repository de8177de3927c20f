"""Fault-tolerance benchmark (CI: smallest size only): torchft live recovery vs checkpoint restart.

Runs the real training stage (a local Ray, torchft lighthouse, one Ray actor per
replica group, gloo on CPU or NCCL with ``--device cuda``) on a tiny model, twice.

Tokens: every committed step is counted once, with the tokens of the quorum that
committed it (each group's rank 0 reports the same step; a step redone after a
restart is not counted again). The undisturbed rate ``R`` (tokens/s) is the median
of the ``--warmup-steps`` full-quorum steps before the first kill.

1. torchft, ``--kills`` times at a random step: SIGKILL the worker process(es) of a
   random replica group. Measured:
   - detect: kill -> the run's ``InterruptionEvent.detected_at`` (when the engine
     knew: Ray reported the process dead, or a survivor committed without it);
   - resume: kill -> the restarted group's first committed step in the full quorum
     (a warm standby takes the group's place, or Ray restarts the actor; torchft
     heals it from a live peer, reading no checkpoint);
   - lost seconds by tokens (the headline): over the window from the last committed
     step before the kill to ``--settle-steps`` full-quorum steps after the rejoin,
     window seconds minus (new tokens committed in the window) / R. The dead
     group's share of every batch committed by the smaller quorum counts as lost;
   - lost seconds by steps (secondary): the survivor's stalls, each gap between its
     committed steps beyond the undisturbed step time.
2. The checkpoint-restart baseline (what Ray Train or torchrun elastic do), no
   spares, checkpointing every ``--checkpoint-every`` steps (default: the production
   default, ``stages.checkpointing.config.DEFAULT_INTERVAL_STEPS``). ``--restart-kills``
   times, SIGKILL every group at once at a step drawn uniformly within a checkpoint
   interval, after the first checkpoint: the job restarts from the newest complete
   DCP checkpoint and redoes the steps since. Lost seconds by tokens over the same
   kind of window: the last committed step before the kill to ``--settle-steps`` steps
   beyond the step reached before the kill, window seconds minus (new tokens: steps
   beyond the one reached before the kill) / R. Redone steps add nothing.

3. The peer, Ray Train V2 (``benchmarks/ray_train_baseline.py``): ``TorchTrainer``
   with ``FailureConfig``, DDP, the same model, batch and optimizer, a checkpoint
   every ``--checkpoint-every`` steps (async upload), ``--ray-train-kills`` SIGKILLs of
   worker rank 1 drawn like the restart baseline's; Ray Train restarts the worker
   group from its newest checkpoint. Same token accounting, at its own undisturbed
   rate; ``lost_ratio_tokens_ray_train`` is its median over torchft's.

With ``--churn-s T --duration-s D`` the torchft run instead SIGKILLs a random group
every T seconds for D seconds (a kill may land before the standby is refilled) and
reports ``churn_efficiency``: tokens committed in those D seconds over the
undisturbed full-quorum rate times D (a fault-free run of the same length).

The torchft run uses the production recovery configuration
(``stages.trainer.fleet.recovery.production_recovery``: warm standbys, FT timeouts) and,
on cpu, each group pinned to its own cores, so a dead group's compute stays idle.

Prints one line per measurement and ends with one JSON line: ``lost_ratio_tokens``
(restart / torchft, median lost seconds by tokens: the headline), the token-basis
medians of both sides, detect and resume medians and maxima, and the step-basis ft
loss for reference. Goals on the 2-core CPU testbed: detect <= 3 s, resume <= 15 s.
Timings on a shared, loaded machine are noisy.

    .venv/bin/python benchmarks/fault_tolerance.py --groups 2 --kills 3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks import ray_train_baseline
from benchmarks.ray_join import add_ray_address, init_ray
from stages.base import GateOutcome, StageContext
from stages.checkpointing.config import DEFAULT_INTERVAL_STEPS, CheckpointPolicy
from stages.events import Event, InterruptionEvent, StepEvent
from stages.trainer.config import ModelSpec, TrainingTarget, TrainStageConfig
from stages.trainer.fleet.recovery import RecoveryConfig, production_recovery

# How long to wait for one expected event before the benchmark gives up.
EVENT_TIMEOUT_S = 300.0
# Steps to run in the full quorum before the first kill (and to time the step rate).
WARMUP_STEPS = 30
# Full-quorum steps after a rejoin that still count towards the failure's cost.
SETTLE_STEPS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--groups", type=int, default=2, help="replica groups (>= 2)")
    p.add_argument("--preset", default="llama-tiny", help="configs/models preset")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kills", type=int, default=3, help="single-group SIGKILLs")
    p.add_argument(
        "--spares",
        type=int,
        default=None,
        help="warm standbys in the torchft run (default: what production "
        "launches for a one-node booking; 0: Ray restarts only)",
    )
    p.add_argument(
        "--ranks-per-group",
        type=int,
        default=1,
        help="ranks per replica group (> 1: FSDP2 inside the group; a standby group has as many)",
    )
    p.add_argument(
        "--restart-kills",
        type=int,
        default=2,
        help="all-group SIGKILLs (checkpoint-restart baseline)",
    )
    p.add_argument(
        "--kill-steps",
        default="",
        help="comma-separated steps between torchft kills (default: random in --kill-gap)",
    )
    p.add_argument("--kill-gap", default="15,40", help="min,max random steps between torchft kills")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=DEFAULT_INTERVAL_STEPS,
        help="steps between saves (default: the production default)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP_STEPS,
        help="full-quorum steps before the first kill of each run, the last of which "
        "time the undisturbed rate (>= 2)",
    )
    p.add_argument(
        "--settle-steps",
        type=int,
        default=SETTLE_STEPS,
        help="steps after a rejoin (or past the pre-kill step) counted in a failure's cost",
    )
    p.add_argument(
        "--ray-train-kills",
        type=int,
        default=2,
        help="worker SIGKILLs of the Ray Train V2 baseline (0: not run)",
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=2048, help="global batch tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=4, help="Ray logical CPUs")
    add_ray_address(p)
    p.add_argument(
        "--churn-s",
        type=float,
        default=0.0,
        help="churn mode: SIGKILL a random group every this many seconds "
        "(instead of --kills), for --duration-s",
    )
    p.add_argument("--duration-s", type=float, default=180.0, help="churn mode's length")
    p.add_argument(
        "--heartbeat-ms",
        type=int,
        default=None,
        help="override FaultToleranceConfig.heartbeat_timeout_ms",
    )
    args = p.parse_args(argv)
    if args.groups < 2:
        p.error("--groups must be >= 2 (one must survive)")
    if args.warmup_steps < 2 or args.settle_steps < 1:
        p.error("--warmup-steps must be >= 2 (one step gap) and --settle-steps >= 1")
    if args.spares is None:
        args.spares = recovery(args).spare_groups
    return args


def recovery(args: argparse.Namespace) -> RecoveryConfig:
    """The production recovery configuration of a one-node booking of this shape."""
    return production_recovery(
        {"node_count": 1, "gpus_per_node": args.groups * args.ranks_per_group}
    )


def write_train_data(tmp: Path) -> Path:
    """A small text corpus the benchmarks train on (the engine reads files)."""
    data = tmp / "train.jsonl"
    with data.open("w") as f:
        for i in range(4000):
            f.write(
                json.dumps({"text": f"doc {i}: " + "lorem ipsum dolor sit amet " * (i % 9 + 1)})
                + "\n"
            )
    return data


def stage_config(
    args: argparse.Namespace, *, spares: int, ckpt_root: Path, data: Path
) -> TrainStageConfig:
    """The training stage the benchmarks run: ``args``' preset, batch, groups and
    checkpoint interval, with the production recovery configuration."""
    ft_over = recovery(args).fault_tolerance.model_dump(mode="json")
    if getattr(args, "heartbeat_ms", None) is not None:
        ft_over["heartbeat_timeout_ms"] = args.heartbeat_ms
    return TrainStageConfig.model_validate(
        dict(
            model=ModelSpec(preset=args.preset, size="bench"),
            target=TrainingTarget(
                max_steps=1_000_000,
                seq_len=args.seq_len,
                global_batch_tokens=args.batch_tokens,
                warmup_steps=10,
            ),
            checkpoint=CheckpointPolicy(
                interval_steps=args.checkpoint_every,
                keep=2,
                storage_uri=f"file://{ckpt_root}",
            ),
            loss_spike={"enabled": False},  # a proposal would pause the run for a human
            fault_tolerance=ft_over,
            replica_groups=args.groups,
            spare_groups=spares,
            ranks_per_group=args.ranks_per_group,
            device=args.device,
            train_files=[str(data)],
            worker_num_cpus=0.5,
        ),
        strict=False,
    )


class Watcher:
    """Collects the stage's events; waits for the first one matching a predicate."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.cond = threading.Condition()

    def emit(self, e: Event) -> None:
        with self.cond:
            self.events.append(e)
            self.cond.notify_all()

    def steps(self) -> list[StepEvent]:
        with self.cond:
            return [e for e in self.events if isinstance(e, StepEvent) and e.committed]

    def wait(self, pred: Callable[[StepEvent], bool], what: str) -> StepEvent:
        e = self.wait_event(lambda e: isinstance(e, StepEvent) and e.committed and pred(e), what)
        assert isinstance(e, StepEvent)
        return e

    def wait_event(self, pred: Callable[[Event], bool], what: str) -> Event:
        deadline = time.time() + EVENT_TIMEOUT_S
        with self.cond:
            seen = 0
            while True:
                for e in self.events[seen:]:
                    if pred(e):
                        return e
                seen = len(self.events)
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError(f"no {what} within {EVENT_TIMEOUT_S:.0f}s")
                self.cond.wait(min(left, 0.5))

    def max_step(self) -> int:
        return max((e.step for e in self.steps()), default=0)


def committed_tokens(w: Watcher, after_ts: float, until_ts: float, beyond_step: int) -> int:
    """Tokens of the steps numbered above ``beyond_step`` committed in (after, until]:
    each step once (its last report), so redone steps and a second group's report of
    the same step add nothing."""
    by_step: dict[int, int] = {}
    for e in sorted(w.steps(), key=lambda e: e.ts):
        if after_ts < e.ts <= until_ts and e.step > beyond_step:
            by_step[e.step] = e.tokens
    return sum(by_step.values())


def full_rate(w: Watcher, groups: int, warmup_steps: int) -> tuple[float, float]:
    """(seconds per step, tokens per second) of undisturbed full-quorum training,
    from consecutive committed full-quorum steps of group 0. A step's ``tokens`` is
    already the whole quorum's."""
    evs = sorted(
        (e for e in w.steps() if e.replica_group == 0 and e.quorum_size == groups),
        key=lambda e: e.step,
    )
    gaps = [b.ts - a.ts for a, b in itertools.pairwise(evs) if b.step == a.step + 1]
    step_s = statistics.median(gaps[-warmup_steps:])
    tokens_per_step = statistics.median(e.tokens for e in evs[-warmup_steps:])
    return step_s, tokens_per_step / step_s


def last_before(w: Watcher, t: float) -> StepEvent:
    return max((e for e in w.steps() if e.ts <= t), key=lambda e: e.ts)


def ft_kill(
    w: Watcher,
    run_id: str,
    group: int,
    groups: int,
    step_s: float,
    tok_rate: float,
    settle_steps: int,
) -> dict[str, float]:
    from stages.trainer import kill_replica_group

    t_kill, _ = kill_replica_group(run_id, group)
    start = last_before(w, t_kill)
    res = w.wait(
        lambda e: e.ts > t_kill and e.replica_group == group and e.quorum_size == groups,
        "restarted group in the full quorum",
    )
    # Detect: the run's own report of when it knew (a standby may take the group's
    # place before any survivor commits in a smaller quorum).
    det = w.wait_event(
        lambda e: (
            isinstance(e, InterruptionEvent)
            and e.replica_group == group
            and e.detected_at >= t_kill - 1.0
            and e.recovered_at is not None
        ),
        "the run's report of the interruption",
    )
    assert isinstance(det, InterruptionEvent)
    survivor = (group + 1) % groups
    # Settle: a few full-quorum steps after the rejoin (healing stalls the sender too).
    end = w.wait(
        lambda e: e.replica_group == survivor and e.step >= res.step + settle_steps,
        "steps after the rejoin",
    )
    # Step basis: the survivor's stalls (waiting for the quorum to drop the dead group,
    # sending the heal), each gap beyond the undisturbed step time.
    ts = sorted(
        e.ts for e in w.steps() if e.replica_group == survivor and start.ts <= e.ts <= end.ts
    )
    lost = sum(max(0.0, b - a - step_s) for a, b in itertools.pairwise(ts))
    # Token basis: the missing group's share of every batch counts as lost as well.
    tokens = committed_tokens(w, start.ts, end.ts, start.step)
    lost_tok = (end.ts - start.ts) - tokens / tok_rate
    return {
        "group": group,
        "detect_s": max(0.0, det.detected_at - t_kill),
        "resume_s": res.ts - t_kill,
        "lost_s": max(0.0, lost),
        "lost_token_s": max(0.0, lost_tok),
    }


def churn(
    w: Watcher,
    run_id: str,
    groups: int,
    every_s: float,
    duration_s: float,
    tok_rate: float,
    rng: random.Random,
) -> dict[str, float]:
    """SIGKILL a random group every ``every_s`` seconds for ``duration_s`` (a kill may
    land before the standby is refilled, or on a group still healing). Efficiency:
    the tokens committed in the window over what the undisturbed full-quorum rate
    commits in the same time (the fault-free run of the same length)."""
    from stages.trainer import kill_replica_group

    t0 = time.time()
    kills = 0
    while (t_next := t0 + (kills + 1) * every_s) < t0 + duration_s:
        time.sleep(max(0.0, t_next - time.time()))
        _, pids = kill_replica_group(run_id, rng.randrange(groups))
        kills += bool(pids)
        print(f"churn kill {kills} at +{time.time() - t0:.1f}s: pids {pids}", flush=True)
    time.sleep(max(0.0, t0 + duration_s - time.time()))
    tokens = committed_tokens(w, t0, t0 + duration_s, last_before(w, t0).step)
    return {
        "churn_kills": kills,
        "churn_efficiency": round(tokens / (tok_rate * duration_s), 3),
        "churn_tokens_per_s": round(tokens / duration_s, 1),
    }


def restart_kill(
    w: Watcher, run_id: str, groups: int, tok_rate: float, settle_steps: int
) -> dict[str, float]:
    from stages.trainer import kill_replica_groups

    t_kill, _ = kill_replica_groups(run_id, list(range(groups)))
    start = last_before(w, t_kill)
    reached = w.max_step()
    back = w.wait(lambda e: e.ts > t_kill and e.step >= reached, "the pre-kill step again")
    end = w.wait(
        lambda e: e.ts > t_kill and e.step >= reached + settle_steps,
        "steps after the pre-kill step",
    )
    # Only steps beyond the one reached before the kill are new work.
    tokens = committed_tokens(w, start.ts, end.ts, reached)
    lost_tok = (end.ts - start.ts) - tokens / tok_rate
    return {"reached": reached, "back_s": back.ts - t_kill, "lost_token_s": max(0.0, lost_tok)}


def reached(step: int, e: StepEvent) -> bool:
    return e.step >= step


def restart_kill_steps(interval: int, n: int, rng: random.Random) -> list[int]:
    """Kill steps after the first checkpoint, each uniform within an interval:
    the k-th kill lands in interval k (steps k*interval+1 .. (k+1)*interval)."""
    return [(k + 1) * interval + rng.randint(1, interval) for k in range(n)]


def gaps(args: argparse.Namespace, n: int, rng: random.Random) -> list[int]:
    if args.kill_steps:
        fixed = [int(x) for x in args.kill_steps.split(",") if x.strip()]
        return [fixed[i % len(fixed)] for i in range(n)]
    lo, hi = (int(x) for x in args.kill_gap.split(","))
    return [rng.randint(lo, hi) for _ in range(n)]


class Session:
    """One training-stage run in a background thread, cancelled on exit."""

    def __init__(self, cfg: TrainStageConfig, tmp: Path, run_id: str):
        from stages.trainer import TrainingStage

        self.w = Watcher()
        self.run_id = run_id
        self.ctx = StageContext(
            run_id=run_id, booking_id="bench", workdir=tmp / run_id, emit=self.w.emit
        )
        self.ctx.workdir.mkdir(parents=True)
        self.outcome: list[GateOutcome] = []
        stage = TrainingStage(cfg)
        self.thread = threading.Thread(
            target=lambda: self.outcome.append(stage.run(self.ctx)), daemon=True
        )
        self.thread.start()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctx.cancel_event.set()
        self.thread.join(timeout=60)

    def warm(self, groups: int, steps: int) -> tuple[float, float]:
        # full_rate measures group 0's steps: wait for its own (the engine forwards each
        # group's events at its own poll).
        self.w.wait(
            lambda e: e.replica_group == 0 and e.step >= steps and e.quorum_size == groups,
            "warm-up steps",
        )
        return full_rate(self.w, groups, steps)

    def reach(self, gap: int, groups: int) -> None:
        target = self.w.max_step() + gap
        self.w.wait(lambda e: e.step >= target and e.quorum_size == groups, f"step {target}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import ray

    from orchestrator.runtime.launch import use_scratch_launch_key

    args = parse_args(argv)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="ito-ftbench-"))
    data = write_train_data(tmp)

    def config(spares: int, ckpt_dir: str) -> TrainStageConfig:
        return stage_config(args, spares=spares, ckpt_root=tmp / ckpt_dir, data=data)

    use_scratch_launch_key(tmp)  # run by hand, no server holds one
    init_ray(args.ray_address, tmp / "ray", args.num_cpus)
    t_start = time.time()
    churned: dict[str, float] = {}
    ft_results: list[dict[str, float]] = []
    ray_train: dict[str, Any] = {}
    restart_results: list[dict[str, float]] = []
    try:
        # 1. torchft live recovery (Ray restarts the actor, or a warm spare steps in).
        with Session(config(args.spares, "ckpt-ft"), tmp, f"ftb{os.getpid()}") as sess:
            step_s, tok_rate = sess.warm(args.groups, args.warmup_steps)
            print(f"full quorum: {step_s * 1000:.0f} ms/step, {tok_rate:.0f} tokens/s", flush=True)
            if args.churn_s:
                churned = churn(
                    sess.w, sess.run_id, args.groups, args.churn_s, args.duration_s, tok_rate, rng
                )
                print(f"churn: {churned}", flush=True)
            for gap in gaps(args, 0 if args.churn_s else args.kills, rng):
                sess.reach(gap, args.groups)
                r = ft_kill(
                    sess.w,
                    sess.run_id,
                    rng.randrange(args.groups),
                    args.groups,
                    step_s,
                    tok_rate,
                    args.settle_steps,
                )
                ft_results.append(r)
                print(
                    f"ft kill rg{r['group']:.0f}: detect {r['detect_s']:.2f}s resume "
                    f"{r['resume_s']:.2f}s lost {r['lost_s']:.2f}s (tokens "
                    f"{r['lost_token_s']:.2f}s)",
                    flush=True,
                )
        # 2. The baseline: every group killed, the job restarts from its last checkpoint.
        with Session(config(0, "ckpt-restart"), tmp, f"rsb{os.getpid()}") as sess:
            # Each side is valued at its own rate.
            _, tok_rate_r = sess.warm(args.groups, args.warmup_steps)
            for kill_at in restart_kill_steps(args.checkpoint_every, args.restart_kills, rng):
                sess.w.wait(functools.partial(reached, kill_at), f"step {kill_at}")
                r = restart_kill(sess.w, sess.run_id, args.groups, tok_rate_r, args.settle_steps)
                restart_results.append(r)
                print(
                    f"restart kill at step {r['reached']:.0f}: back at it after "
                    f"{r['back_s']:.2f}s, lost {r['lost_token_s']:.2f}s (tokens)",
                    flush=True,
                )
        # 3. The peer: Ray Train V2 restarting its worker group from a checkpoint.
        if args.ray_train_kills:
            ray_train = ray_train_baseline.measure(
                preset=args.preset,
                workers=args.groups * args.ranks_per_group,
                seq_len=args.seq_len,
                batch_tokens=args.batch_tokens,
                lr=config(0, "ckpt-ray-train").target.learning_rate,
                checkpoint_every=args.checkpoint_every,
                kill_steps=restart_kill_steps(args.checkpoint_every, args.ray_train_kills, rng),
                warmup_steps=args.warmup_steps,
                settle_steps=args.settle_steps,
                device=args.device,
            )
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key: str, rs: list[dict[str, float]]) -> float:
        return round(statistics.median(r[key] for r in rs), 3) if rs else float("nan")

    ft_lost = med("lost_s", ft_results)
    ft_lost_tok = med("lost_token_s", ft_results)
    restart_lost_tok = med("lost_token_s", restart_results)
    summary = {
        "kills": len(ft_results),
        "detect_s_median": med("detect_s", ft_results),
        "detect_s_max": round(max((r["detect_s"] for r in ft_results), default=math.nan), 3),
        "resume_s_median": med("resume_s", ft_results),
        "resume_s_max": round(max((r["resume_s"] for r in ft_results), default=math.nan), 3),
        **churned,
        "ft_lost_token_s_median": ft_lost_tok,
        "restart_lost_token_s_median": restart_lost_tok,
        "lost_ratio_tokens": round(restart_lost_tok / ft_lost_tok, 2) if ft_lost_tok > 0 else None,
        **ray_train,
        "lost_ratio_tokens_ray_train": round(
            ray_train["ray_train_lost_token_s_median"] / ft_lost_tok, 2
        )
        if ray_train and ft_lost_tok > 0
        else None,
        "ft_lost_step_s_median": ft_lost,
        "checkpoint_every": args.checkpoint_every,
        "restart_kills": len(restart_results),
        "groups": args.groups,
        "ranks_per_group": args.ranks_per_group,
        "spares": args.spares,
        "preset": args.preset,
        "device": args.device,
        "step_ms": round(step_s * 1000, 1),
        "tokens_per_s": round(tok_rate),
        "wall_s": round(time.time() - t_start, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
