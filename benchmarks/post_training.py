"""Post-training benchmark: the rollout fleet at eta = 0 (synchronous) vs eta = 2.

    PYTHONPATH=. .venv/bin/python benchmarks/post_training.py [--steps N] [--workers W]

One run of a real local Ray with W rollout actors (HF generate on CPU) and the GRPO
learner in this process, on the synthetic verifiable task with a tiny random-init
policy; first eta = 0 (every rollout is generated with the trainer's current
version, so trainer and rollouts take turns: the synchronous baseline veRL and trl's
GRPOTrainer use), then eta = 2 (AReaL-style bounded staleness: rollouts for the next
steps are generated while the trainer trains), same seeds, same step count.

What each number counts:
- ``samples_per_s``: completions generated (accepted and dropped groups) per second
  of the RLVR loop's wall time;
- ``idle_frac`` (trainer): fraction of the loop's wall time the trainer waited for a
  batch of rollouts;
- ``sync_s_median``: median seconds from putting a policy version into Ray's object
  store to every worker having loaded it: the put in the learner's process + the
  slowest worker's fetch and load (a worker fetches the ref itself; on the engine
  the put runs on the learner's rank 0, here the in-process learner stands in for it);
- ``idle_ratio``: eta2 trainer idle fraction / eta0 trainer idle fraction (< 1: the
  asynchronous fleet keeps the trainer busier);
- ``sync_s_median_object_store`` / ``sync_s_median_collective``: the same median for
  each weight path side by side, the eta = 2 run repeated with
  ``weight_sync="collective"`` (gloo broadcast of flat buckets from the learner's
  process: packing the buckets + the slowest worker's receive and load, which
  includes waiting for the other ranks to join the broadcast);
- ``resume_s``: a run with a resume state every step is stopped after step 1 and
  relaunched with the same workdir; seconds from the relaunch (learner built,
  actors started, state restored) to its first trained step.

- ``learner_tokens_per_s``: the GRPO learner on the training engine (objective
  ``grpo``, torchft replica groups as actors) with 1 and with 2 learner replica groups
  (``learner_groups``), each fed the same pre-written step batches of the same global
  size: tokens of committed steps per second between the first and the last commit
  (no fleet in the loop, so this is the learner's own rate).

Ends with one JSON line: eta0_idle_frac, eta2_idle_frac, idle_ratio,
eta0_samples_per_s, eta2_samples_per_s, sync_s_median (object store, both eta runs),
sync_s_median_object_store, sync_s_median_collective, resume_s, learner_groups,
learner_tokens_per_s (by group count).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Stop(Exception):
    """Raised from the event sink after a step: the interruption resume_s recovers from."""


def run_once(
    eta: int,
    args: argparse.Namespace,
    policy: Path,
    task: dict[str, Path],
    *,
    weight_sync: str = "object_store",
    workdir: Path | None = None,
    stop_after: int | None = None,
) -> tuple[dict[str, float], list[float], float]:
    """(summary, sync seconds, time.perf_counter() of the first trained step)."""
    from stages.events import MetricsEvent
    from stages.post_training.config import RLVRConfig
    from stages.post_training.data import load_rows
    from stages.post_training.hf_io import load_model, load_tokenizer
    from stages.post_training.pools import RayPool
    from stages.post_training.rl import GRPOLearner, RequestMaker, run_rlvr
    from stages.post_training.rollout import WorkerSpec

    ref = {
        "uri": f"file://{task['rlvr']}",
        "sha256": "0" * 64,
        "provenance": {"source": "synthetic", "license": "MIT"},
    }
    cfg = RLVRConfig.model_validate(
        {
            "data": ref,
            "steps": args.steps,
            "reward": "first_number_match",
            "group_size": args.group_size,
            "groups_per_step": args.groups,
            "max_completion_tokens": args.max_tokens,
            "overlong_buffer_tokens": min(4, args.max_tokens // 2),
            "learning_rate": 1e-3,
            "max_staleness": eta,
            "rollout_workers": args.workers,
            "dynamic_sampling": True,
            "seed": 0,
            "weight_sync": weight_sync,
            "checkpoint_every_steps": 1 if workdir is not None else 0,
        }
    )
    tok = load_tokenizer(policy)
    learner = GRPOLearner(cfg, load_model(policy), tok.pad_token_id)
    specs = [
        WorkerSpec(
            index=i,
            model_dir=str(policy),
            reward=cfg.reward,
            max_completion_tokens=cfg.max_completion_tokens,
            overlong_buffer_tokens=4,
            overlong_penalty_factor=1.0,
        )
        for i in range(args.workers)
    ]
    first: list[float] = []

    def emit(e: Any) -> None:
        if isinstance(e, MetricsEvent):
            first.append(time.perf_counter())
            if stop_after is not None and e.step == stop_after:
                raise Stop

    name = f"bench-eta{eta}-{weight_sync.replace('_', '-')}-{time.monotonic_ns()}"
    pool = RayPool(name, specs, weight_sync=weight_sync)  # type: ignore[arg-type]
    try:
        if workdir is None:
            pool.identities(120)  # the actors are up before the clock starts
        result, ctl = run_rlvr(
            cfg,
            learner,
            pool,
            RequestMaker(cfg, tok, load_rows("rlvr", cfg.data.uri)),
            emit=emit,
            workdir=workdir,
        )
    finally:
        pool.close()
    return result.summary, list(ctl.stats.sync_s), first[0] if first else float("nan")


def measure_resume(args: argparse.Namespace, policy: Path, task: dict[str, Path]) -> float:
    """Stop after step 1 (a resume state saved), relaunch: seconds to its first step."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-pt-resume-"))
    try:
        with contextlib.suppress(Stop):
            run_once(2, args, policy, task, workdir=workdir, stop_after=1)
        t0 = time.perf_counter()
        _, _, first = run_once(2, args, policy, task, workdir=workdir)
        return first - t0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def learner_rate(args: argparse.Namespace, policy: Path, groups: int, tmp: Path) -> float:
    """Committed tokens per second of the engine's GRPO learner with ``groups`` groups."""
    import threading

    import torch

    from stages.events import StepEvent
    from stages.post_training.config import RLVRConfig
    from stages.post_training.hf_io import load_tokenizer
    from stages.post_training.learner import rlvr_train_config
    from stages.post_training.rollout import RolloutGroup
    from stages.post_training.step_groups import step_groups, write_step_groups
    from stages.trainer.config import TrainStageConfig
    from stages.trainer.engine import TrainingEngine

    cfg = RLVRConfig.model_validate(
        {
            "data": {
                "uri": "file:///x",
                "sha256": "0" * 64,
                "provenance": {"source": "s", "license": "MIT"},
            },
            "steps": args.learner_steps,
            "group_size": args.group_size,
            "groups_per_step": max(2, args.groups),  # splits over 2 groups
            "max_completion_tokens": args.max_tokens,
            "overlong_buffer_tokens": min(4, args.max_tokens // 2),
            "learning_rate": 1e-3,
        }
    )
    tok = load_tokenizer(policy)
    work = tmp / f"learner-g{groups}"
    gen = torch.Generator().manual_seed(0)
    for k in range(cfg.steps):
        batch: list[RolloutGroup | None] = []
        for g in range(cfg.groups_per_step):
            comps = [
                torch.randint(3, int(tok.vocab_size), (args.max_tokens,), generator=gen).tolist()
                for _ in range(cfg.group_size)
            ]
            rewards = torch.rand(cfg.group_size, generator=gen).tolist()
            batch.append(
                RolloutGroup(
                    id=k * cfg.groups_per_step + g,
                    version=k,
                    worker=0,
                    prompt_ids=[3, 4, 5, 6],
                    completion_ids=comps,
                    behav_logp=[[-1.0] * args.max_tokens for _ in comps],
                    lengths=[args.max_tokens] * cfg.group_size,
                    truncated=[False] * cfg.group_size,
                    rewards=rewards,
                    task_rewards=rewards,
                    gen_s=0.0,
                )
            )
        write_step_groups(step_groups(k, batch, cfg, int(tok.pad_token_id)), work / "rollouts")
    tcfg = rlvr_train_config(
        cfg, base=policy, work=work, max_prompt_tokens=4, train=None, device="cpu"
    )
    tcfg = TrainStageConfig.model_validate(
        {**tcfg.model_dump(), "replica_groups": groups}, strict=False
    )
    (work / "checkpoints").mkdir(parents=True, exist_ok=True)
    steps: list[StepEvent] = []
    TrainingEngine(
        tcfg,
        run_id=f"bench-learner-g{groups}-{time.monotonic_ns()}",
        checkpoint_dir=work / "checkpoints",
        role_shards={},
        emit=lambda e: steps.append(e) if isinstance(e, StepEvent) and e.committed else None,
        cancel_event=threading.Event(),
        wait_decision=lambda _id, _t: None,
    ).run()
    by_step = {e.step: e for e in steps}  # every group's rank 0 reports each step
    ordered = [by_step[s] for s in sorted(by_step)]
    if len(ordered) < 2:
        return float("nan")
    span = ordered[-1].ts - ordered[0].ts
    return sum(e.tokens for e in ordered[1:]) / max(span, 1e-9)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 5) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--learner-steps", type=int, default=8)
    args = ap.parse_args()

    import ray

    from orchestrator.runtime.launch import use_scratch_launch_key
    from stages.post_training.synthetic import build_tiny_policy, write_task

    tmp = Path(tempfile.mkdtemp(prefix="bench-pt-"))
    use_scratch_launch_key(tmp)  # run by hand, no server holds one
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(tmp / "ray"),
        log_to_driver=False,
    )
    try:
        policy = build_tiny_policy(tmp / "policy", hidden=args.hidden, layers=2)
        task = write_task(tmp / "task", rl_numbers=tuple(range(10)))
        out: dict[int, dict[str, float]] = {}
        syncs: list[float] = []
        for eta in (0, 2):
            out[eta], s, _ = run_once(eta, args, policy, task)
            syncs += s
            if eta == 2:
                syncs_object_store = s
        _, syncs_collective, _ = run_once(2, args, policy, task, weight_sync="collective")
        resume_s = measure_resume(args, policy, task)
        learner = {g: learner_rate(args, policy, g, tmp) for g in (1, 2)}
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{'eta':>4} {'samples/s':>10} {'trainer idle':>13} {'rollout idle':>13} "
        f"{'staleness max':>14} {'drop rate':>10}"
    )
    for eta, m in out.items():
        print(
            f"{eta:>4} {m['rollout_samples_per_s']:>10.1f} {m['trainer_idle_frac']:>13.3f} "
            f"{m['rollout_idle_frac']:>13.3f} {m['staleness_max']:>14.0f} "
            f"{m['drop_rate']:>10.3f}"
        )
    e0, e2 = out[0], out[2]
    line: dict[str, Any] = {
        "eta0_idle_frac": round(e0["trainer_idle_frac"], 4),
        "eta2_idle_frac": round(e2["trainer_idle_frac"], 4),
        "idle_ratio": round(e2["trainer_idle_frac"] / max(e0["trainer_idle_frac"], 1e-9), 4),
        "eta0_samples_per_s": round(e0["rollout_samples_per_s"], 2),
        "eta2_samples_per_s": round(e2["rollout_samples_per_s"], 2),
        "sync_s_median": _median(syncs),
        "sync_s_median_object_store": _median(syncs_object_store),
        "sync_s_median_collective": _median(syncs_collective),
        "resume_s": round(resume_s, 3),
        "learner_groups": sorted(learner),
        "learner_tokens_per_s": {str(g): round(v, 1) for g, v in learner.items()},
    }
    print(
        f"weight sync median (eta 2): object_store {line['sync_s_median_object_store']} s, "
        f"collective {line['sync_s_median_collective']} s; resume {line['resume_s']} s"
    )
    print(f"learner tokens/s on the engine by replica groups: {line['learner_tokens_per_s']}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
