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
  store to every worker having loaded it (put time + the slowest worker's load time);
- ``idle_ratio``: eta2 trainer idle fraction / eta0 trainer idle fraction (< 1: the
  asynchronous fleet keeps the trainer busier).

Ends with one JSON line: eta0_idle_frac, eta2_idle_frac, idle_ratio,
eta0_samples_per_s, eta2_samples_per_s, sync_s_median (over both runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_once(
    eta: int, args: argparse.Namespace, policy: Path, task: dict[str, Path]
) -> tuple[dict[str, float], list[float]]:
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
    pool = RayPool(f"bench-eta{eta}", specs)
    try:
        pool.identities(120)  # the actors are up before the clock starts
        result, ctl = run_rlvr(
            cfg, learner, pool, RequestMaker(cfg, tok, load_rows("rlvr", ref["uri"]))
        )
    finally:
        pool.close()
    return result.summary, list(ctl.stats.sync_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    args = ap.parse_args()

    import ray

    from stages.post_training.synthetic import build_tiny_policy, write_task

    tmp = Path(tempfile.mkdtemp(prefix="bench-pt-"))
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
            out[eta], s = run_once(eta, args, policy, task)
            syncs += s
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
        "sync_s_median": round(statistics.median(syncs), 5) if syncs else None,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
