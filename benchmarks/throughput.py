"""Throughput benchmark (CI: smallest size only): tokens committed per second of booked
time, the engine against Ray Train V2 and a plain loop, with no failure and with a
replica group SIGKILLed every N seconds.

Per model preset (default llama-small and llama-25m, where compute dominates a step),
three sides run one after another on the same cores, each with the same model, global
batch, sequence length, AdamW and checkpoint interval (``--checkpoint-every``, the
production default):

- ``engine``: the real training stage (``stages.trainer``) with the production recovery
  configuration (warm standbys, torchft lighthouse and managers, async sealed DCP
  checkpoints), ``--groups`` replica groups of one rank, each pinned to its own core;
- ``ray_train``: Ray Train V2's ``TorchTrainer`` with DDP (``prepare_model``), one worker
  per group pinned to its own core, a checkpoint reported every interval with the async
  upload (``benchmarks/ray_train_baseline.py``);
- ``plain``: one process pinned to one core, one group's share of the global batch per
  step, the same model and optimizer, ``torch.save`` every interval: what one device
  does per step with nothing added (no communication, no fault tolerance).

The engine and Ray Train are measured in ``--rounds`` rounds, each side started afresh
in each, in ABBA order (engine then Ray Train, then Ray Train then engine, ...): this
shared machine's speed drifts by as much as 1.7x within an hour, and a drift that is
linear over the run falls on both sides alike in that order.

What each number counts:
- ``*_step_ms``: wall time per optimizer step over ``--measure-steps`` consecutive steps
  after ``--warmup-steps`` (the engine's also after its standby is warm: the standby's
  start-up shares this machine's two cores with the ranks, where a GPU node gives it
  cores of its own), checkpoint steps included (a mean, not a median: the saves are
  part of the price); for the engine and Ray Train the mean of the rounds' figures;
- ``*_tokens_per_s``: global-batch tokens per second over the same steps (plain: its
  share times ``--groups``, i.e. ``--groups`` devices each running a plain loop);
- ``step_efficiency``: engine tokens/s ÷ Ray Train tokens/s with no failure, over all
  rounds (``step_efficiency_rounds``: each round's own);
- ``plain_efficiency``: engine tokens/s ÷ plain tokens/s;
- ``goodput_tokens_per_s`` per failure period N (``--fail-every``): tokens of steps
  committed for the first time within a ``--window-s`` wall window during which a
  replica group (engine: a random group's processes; Ray Train: worker rank 1) is
  SIGKILLed every N seconds, in each side's last round; ``goodput_ratio_N`` is engine ÷
  Ray Train.

The machine's 1-minute load average is printed with the figures: on a shared machine
the timings are noisy. Ends with one JSON line.

    .venv/bin/python benchmarks/throughput.py --presets llama-small llama-25m
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
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
from stages.events import FleetEvent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--presets", nargs="+", default=["llama-small", "llama-25m"])
    p.add_argument("--groups", type=int, default=2, help="replica groups / Ray Train workers")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-tokens", type=int, default=4096, help="global batch tokens")
    p.add_argument("--checkpoint-every", type=int, default=DEFAULT_INTERVAL_STEPS)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--measure-steps", type=int, default=15, help="per round and side")
    p.add_argument("--rounds", type=int, default=2, help="engine/Ray Train rounds, ABBA order")
    p.add_argument(
        "--fail-every",
        type=float,
        nargs="*",
        default=[60.0, 20.0],
        help="seconds between SIGKILLs, one window each (none: no failure windows)",
    )
    p.add_argument("--window-s", type=float, default=180.0, help="wall time of each window")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=4, help="Ray logical CPUs")
    add_ray_address(p)
    args = p.parse_args(argv)
    if args.groups < 2:
        p.error("--groups must be >= 2 (one must survive a kill)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.batch_tokens % (args.seq_len * args.groups):
        p.error("--batch-tokens must split into --groups shares of whole sequences")
    # What fault_tolerance.stage_config reads.
    args.ranks_per_group = 1
    args.heartbeat_ms = None
    return args


def plain_loop(cfg: dict[str, Any], out: Any) -> None:
    """One pinned process: forward, backward and AdamW on one group's share of the
    batch, ``torch.save`` of model and optimizer every interval; puts ``None`` after each
    step (its progress) and then its seconds per step."""
    import torch

    from stages.model.lm import build_model, causal_lm_loss
    from stages.presets import load_model_preset

    os.sched_setaffinity(0, [cfg["core"]])
    torch.set_num_threads(1)
    preset = load_model_preset(cfg["preset"])
    model = build_model(preset, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    rows = cfg["tokens"] // cfg["seq_len"]
    ckpt = Path(cfg["ckpt"])
    t_start = 0.0
    for step in range(cfg["warmup"] + cfg["measure"]):
        if step == cfg["warmup"]:
            t_start = time.perf_counter()
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, preset.vocab_size, (rows, cfg["seq_len"]), generator=gen)
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(model, ids).backward()
        opt.step()
        if (step + 1) % cfg["every"] == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
        out.put(None)
    out.put((time.perf_counter() - t_start) / cfg["measure"])


def run_plain(cfg: dict[str, Any]) -> float:
    """``plain_loop`` with ``cfg`` in a spawned process: its seconds per step. The wait
    is bounded per step, not for the whole loop: 40 steps of a 25M model on a slow hour
    outlast any one bound that still catches a hung process."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=plain_loop, args=(cfg, out), daemon=True)
    proc.start()
    while (got := out.get(timeout=ft_bench.EVENT_TIMEOUT_S)) is None:
        pass
    proc.join(timeout=30)
    return float(got)


def measure_plain(args: argparse.Namespace, preset: str, lr: float, tmp: Path) -> float:
    cfg = {
        "core": sorted(os.sched_getaffinity(0))[0],
        "preset": preset,
        "lr": lr,
        "seq_len": args.seq_len,
        "tokens": args.batch_tokens // args.groups,
        "warmup": args.warmup_steps,
        "measure": args.measure_steps,
        "every": args.checkpoint_every,
        "ckpt": str(tmp / "plain.pt"),
    }
    return run_plain(cfg)


def round_order(rounds: int) -> list[tuple[str, str]]:
    """The sides' order in each round, ABBA: a drift linear over the run costs both alike."""
    ab = ("engine", "ray_train")
    return [ab if r % 2 == 0 else ab[::-1] for r in range(rounds)]


def measure_engine(
    args: argparse.Namespace,
    preset: str,
    tmp: Path,
    data: Path,
    rng: random.Random,
    *,
    round_no: int,
    fail_every: list[float],
) -> dict[str, float]:
    """One round of the engine, started afresh: ``engine_step_s`` and, for each period of
    ``fail_every``, its failure window's goodput."""
    cfg = ft_bench.stage_config(
        argparse.Namespace(**{**vars(args), "preset": preset}),
        spares=ft_bench.recovery(args).spare_groups,
        ckpt_root=tmp / f"ckpt-engine-{preset}-{round_no}",
        data=data,
    )
    out: dict[str, float] = {}
    run_id = f"thr{os.getpid()}{preset.replace('-', '')}r{round_no}"
    with ft_bench.Session(cfg, tmp, run_id) as sess:
        w = sess.w

        def full(step: int) -> Any:
            return w.wait(
                lambda e: e.replica_group == 0 and e.step >= step and e.quorum_size == args.groups,
                f"step {step} in the full quorum",
            )

        # Steady state: past the warm-up steps and with every process of the fleet
        # started (a standby's start-up shares this machine's cores with the ranks; on
        # a GPU node it has cores of its own).
        if cfg.spare_groups:
            w.wait_event(
                lambda e: isinstance(e, FleetEvent) and e.action == "standby_warm",
                "the standby warm",
            )
        a = full(max(args.warmup_steps, w.max_step() + 1))
        b = full(a.step + args.measure_steps)
        step_s = (b.ts - a.ts) / (b.step - a.step)
        tok_rate = b.tokens / step_s
        out["engine_step_s"] = step_s
        for every in fail_every:
            full(w.max_step() + 1)  # each window starts in the full quorum
            churned = ft_bench.churn(w, run_id, args.groups, every, args.window_s, tok_rate, rng)
            out[f"engine_goodput_tokens_per_s_{every:g}"] = churned["churn_tokens_per_s"]
            out[f"engine_kills_{every:g}"] = churned["churn_kills"]
    return out


def measure_ray_train(
    args: argparse.Namespace, preset: str, lr: float, *, fail_every: list[float]
) -> dict[str, float]:
    """One round of Ray Train, started afresh: ``ray_train_step_s`` and, for each period
    of ``fail_every``, its failure window's goodput."""
    kills = sum(int(args.window_s // every) for every in fail_every)
    run = ray_train_baseline.Run.start(
        preset=preset,
        workers=args.groups,
        seq_len=args.seq_len,
        batch_tokens=args.batch_tokens,
        lr=lr,
        checkpoint_every=args.checkpoint_every,
        max_failures=kills + 1,
        device=args.device,
    )
    out: dict[str, float] = {}
    try:
        step_s, _ = run.steady_rate(args.warmup_steps, args.measure_steps)
        out["ray_train_step_s"] = step_s
        for every in fail_every:
            reached = max(r[0] for r in run.log.rows())
            # Each window starts with the worker group training (past its last restart).
            run.log.wait(lambda r, s=reached: r[0] > s, "a step before the window")
            churned = run.churn(every, args.window_s, args.batch_tokens)
            out[f"ray_train_goodput_tokens_per_s_{every:g}"] = churned["tokens_per_s"]
            out[f"ray_train_kills_{every:g}"] = churned["kills"]
    finally:
        run.stop()
    if run.errors:
        out["ray_train_error"] = repr(run.errors[0])[:200]  # type: ignore[assignment]
    return out


def summarize(
    args: argparse.Namespace, preset: str, m: dict[str, Any], steps: dict[str, list[float]]
) -> dict[str, Any]:
    """One preset's figures: ``steps`` holds each side's seconds per step, a round each."""
    out: dict[str, Any] = {"preset": preset}
    mean_s = {side: sum(v) / len(v) for side, v in steps.items()}
    for side in ("engine", "ray_train"):
        out[f"{side}_step_ms"] = round(mean_s[side] * 1000, 1)
        out[f"{side}_tokens_per_s"] = round(args.batch_tokens / mean_s[side], 1)
    out["plain_step_ms"] = round(m["plain_step_s"] * 1000, 1)
    out["plain_tokens_per_s"] = round(args.batch_tokens / m["plain_step_s"], 1)
    out["step_efficiency"] = round(mean_s["ray_train"] / mean_s["engine"], 3)
    out["step_efficiency_rounds"] = [
        round(r / e, 3) for e, r in zip(steps["engine"], steps["ray_train"], strict=True)
    ]
    out["plain_efficiency"] = round(m["plain_step_s"] / mean_s["engine"], 3)
    goodput: dict[str, dict[str, float | None]] = {}
    for every in args.fail_every:
        e = m[f"engine_goodput_tokens_per_s_{every:g}"]
        r = m[f"ray_train_goodput_tokens_per_s_{every:g}"]
        goodput[f"{every:g}"] = {
            "engine": round(e, 1),
            "ray_train": round(r, 1),
            "ratio": round(e / r, 2) if r > 0 else None,
            "engine_kills": m[f"engine_kills_{every:g}"],
            "ray_train_kills": m[f"ray_train_kills_{every:g}"],
        }
    out["goodput_tokens_per_s"] = goodput
    if "ray_train_error" in m:
        out["ray_train_error"] = m["ray_train_error"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import ray

    from orchestrator.runtime.launch import use_scratch_launch_key

    args = parse_args(argv)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="ito-throughput-"))
    data = ft_bench.write_train_data(tmp)
    use_scratch_launch_key(tmp)  # run by hand, no server holds one
    t0 = time.time()
    results: list[dict[str, Any]] = []
    try:
        init_ray(args.ray_address, tmp / "ray", args.num_cpus)
        for preset in args.presets:
            lr = ft_bench.stage_config(
                argparse.Namespace(**{**vars(args), "preset": preset}),
                spares=0,
                ckpt_root=tmp / "unused",
                data=data,
            ).target.learning_rate
            m: dict[str, Any] = {"plain_step_s": measure_plain(args, preset, lr, tmp)}
            print(f"{preset} plain: {m['plain_step_s'] * 1000:.1f} ms/step", flush=True)
            steps: dict[str, list[float]] = {"engine": [], "ray_train": []}
            for r, sides in enumerate(round_order(args.rounds)):
                # The failure windows run in each side's last round, after its step rate.
                windows = args.fail_every if r == args.rounds - 1 else []
                for side in sides:
                    got = (
                        measure_engine(args, preset, tmp, data, rng, round_no=r, fail_every=windows)
                        if side == "engine"
                        else measure_ray_train(args, preset, lr, fail_every=windows)
                    )
                    steps[side].append(got.pop(f"{side}_step_s"))
                    m.update(got)
                    ms = steps[side][-1] * 1000
                    print(f"{preset} round {r} {side}: {ms:.1f} ms/step", flush=True)
            results.append(summarize(args, preset, m, steps))
            print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "results": results,
        "groups": args.groups,
        "seq_len": args.seq_len,
        "batch_tokens": args.batch_tokens,
        "checkpoint_every": args.checkpoint_every,
        "rounds": args.rounds,
        "window_s": args.window_s,
        "fail_every": args.fail_every,
        "device": args.device,
        "wall_s": round(time.time() - t0, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
