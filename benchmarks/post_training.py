"""Post-training benchmark: the rollout fleet at eta = 0 (synchronous) vs eta = 2.

    PYTHONPATH=. .venv/bin/python benchmarks/post_training.py [--steps N] [--workers W]

RLVR as the post-training stage launches it (``learner.run_rlvr_on_engine``): the
learner on the training engine (objective ``grpo``: a lighthouse and one torchft
replica group of one rank as Ray actors, DCP checkpoints, the HF export at the end),
fed by W rollout actors (``RayPool``, HF generate on CPU) whose controller runs on a
thread of this process, on a real local Ray with the synthetic verifiable task and a
tiny random-init policy. First eta = 0 (every rollout is generated with the
learner's current version, so learner and rollouts take turns: the synchronous
baseline veRL and trl's GRPOTrainer use), then eta = 2 (AReaL-style bounded
staleness: rollouts for the next steps are generated while the ranks train), same
seeds, same step count. Dynamic sampling drops up to ``--max-dropped-groups``
uniform-reward groups a step (default: the recipe's, 16; the random policy's groups
are nearly all uniform, so each is one more generation). Each launch starts its own
engine and rollout actors under a run id of its own, in a workdir of its own (the
resume's relaunch reuses its stopped run's).

What each number counts:
- ``samples_per_s``: completions generated (accepted and dropped groups) per second
  of the controller's wall time, from ``RLResult.summary`` as the stage reports it
  (``rollout_samples_per_s``). The rollout actors are up before the clock starts;
  the clock starts with the controller, which is when the engine starts its actors
  (lighthouse, one rank), so the wall time includes the engine's start-up (the rank
  builds the model and joins its torchft quorum while the fleet generates the first
  batches) and ends once the last version reached every worker (before the
  engine's HF export);
- ``idle_frac`` (trainer): ``trainer_idle_frac`` of the same summary, the fraction of
  that wall time the controller waited for a batch of rollouts (the ranks wait for
  the batch's file meanwhile); its waits for the ranks to train and publish a step,
  the first of which includes the engine's start-up, are not idle;
- ``idle_ratio``: eta2 trainer idle fraction / eta0 trainer idle fraction (< 1: the
  asynchronous fleet keeps the learner busier);
- ``sync_s_median``: median over the steps of the object-store runs (eta 0 and 2) of
  the ``sync_s`` the controller puts in each step's ``metrics`` event: the newest
  completed sync: the put seconds the learner's rank 0 reports with the version
  (copying the committed weights to CPU and ``ray.put`` in the rank's process) +
  the slowest worker's fetch of the ref and load. The step-1 event carries version
  0, the base folder each worker loads from disk (no put), and is left out; a step
  whose event repeats the previous step's value (no newer sync completed yet) is
  not counted again;
- ``sync_s_median_object_store`` / ``sync_s_median_collective``: the same median for
  each weight path side by side, the eta = 2 run repeated with
  ``weight_sync="collective"`` (gloo broadcast from the learner's rank 0: describing
  and packing the flat buckets on the rank, its first publish also opening the
  rank's store, + the slowest worker's receive and load, which includes waiting for
  the rank and the other workers to join the broadcast);
- ``resume_s``: a run with an engine checkpoint every step is stopped after step 1:
  the driver dies (the controller raises from its event sink, the engine's actors
  are killed) once the engine's step-1 checkpoint is complete on disk; a relaunch
  with the same workdir (and new actors) resumes from it. Seconds from the relaunch
  (rollout and engine actors started, the checkpoint restored, version 1
  republished by the restored rank and sent to the workers, step 2's batch
  generated) to its first trained step: the ``metrics`` event of step 2, sent once
  the rank committed step 2 and published its version.

- ``learner_tokens_per_s``: the GRPO learner on the training engine (objective
  ``grpo``, torchft replica groups as actors) with 1 and with 2 learner replica groups
  (``learner_groups``; ``--learner-groups`` names others), each fed the same
  pre-written step batches of the same global size: tokens of committed steps per
  second between the first and the last commit (no fleet in the loop, so this is the
  learner's own rate).

Ends with one JSON line: eta0_idle_frac, eta2_idle_frac, idle_ratio,
eta0_samples_per_s, eta2_samples_per_s, sync_s_median (object store, both eta runs),
sync_s_median_object_store, sync_s_median_collective, resume_s, learner_groups,
learner_tokens_per_s (by group count).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ray_join import add_ray_address, init_ray

# Bounds on waiting (actors importing torch, a checkpoint written, on a loaded 2-core
# host), never speed.
ACTOR_TIMEOUT_S = 120.0
CHECKPOINT_WAIT_S = 120.0


class Stop(Exception):
    """Raised from the event sink after a step: the interruption resume_s recovers from."""


def run_once(
    eta: int,
    args: argparse.Namespace,
    policy: Path,
    task: dict[str, Path],
    workdir: Path,
    *,
    weight_sync: str = "object_store",
    checkpoint_every: int = 0,
    stop_after: int | None = None,
    warm: bool = True,
    run_id: str | None = None,
    fleet_pids: list[int] | None = None,
) -> tuple[dict[str, float], list[float], float]:
    """One RLVR objective on the engine, fed by a ``RayPool``: (the run's summary, the
    sync seconds of its steps' metrics events from step 2 on, time.perf_counter() of
    its first metrics event, i.e. its first trained step). ``run_id``: a relaunch of
    that run (its checkpoints are sealed for it); ``fleet_pids`` gets the rank pids of
    a launch stopped at ``stop_after``."""
    from stages.base import StageContext
    from stages.checkpointing.storage import list_checkpoints
    from stages.events import Event, MetricsEvent
    from stages.post_training.config import RLVRConfig
    from stages.post_training.data import load_rows
    from stages.post_training.learner import run_rlvr_on_engine
    from stages.post_training.pools import RayPool
    from stages.post_training.rl import RequestMaker
    from stages.post_training.rollout import WorkerSpec
    from stages.post_training.weight_sync import sync_key
    from stages.trainer import replica_group_pids

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
            "max_dropped_groups_per_step": args.max_dropped_groups,
            "seed": 0,
            "weight_sync": weight_sync,
            "checkpoint_every_steps": checkpoint_every,
        }
    )
    ckpts = workdir / "rlvr" / "checkpoints"  # run_rlvr_on_engine's layout
    events: list[tuple[int, float, float]] = []  # (step, sync_s, perf_counter)

    def emit(e: Event) -> None:
        if not isinstance(e, MetricsEvent) or e.scope != "rlvr":
            return  # the engine's own events
        events.append((e.step, float(e.values["sync_s"]), time.perf_counter()))
        if stop_after is not None and e.step == stop_after:
            # The driver dies once the engine holds this step's checkpoint (the ranks
            # wait for the next batch meanwhile, which this controller never writes).
            deadline = time.monotonic() + CHECKPOINT_WAIT_S
            while not any(r.step >= stop_after for r in list_checkpoints(ckpts)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no engine checkpoint of step {stop_after}")
                time.sleep(0.05)
            if fleet_pids is not None:  # the engine's run id is the objective's
                fleet_pids.extend(replica_group_pids(f"{run_id}-rlvr"))
            raise Stop

    # A fresh run id per run (a relaunch keeps its run's: its checkpoints are sealed for it).
    run_id = run_id or f"bench-eta{eta}-{weight_sync.replace('_', '-')}-{time.monotonic_ns()}"
    ctx = StageContext(run_id=run_id, booking_id="bench", workdir=workdir, emit=emit)
    # The pool as the stage makes it (stage.py ``_run_rlvr``).
    pool = RayPool(
        run_id,
        [WorkerSpec.for_recipe(cfg, n, str(policy)) for n in range(cfg.rollout_workers)],
        weight_sync=cfg.weight_sync,
        bucket_bytes=cfg.weight_sync_bucket_mb << 20,
        sync_timeout_s=cfg.weight_sync_timeout_s,
        sync_key=sync_key(ctx.secret),
    )
    try:
        if warm:  # the rollout actors are up before the clock starts
            pool.identities(ACTOR_TIMEOUT_S)
        rows = load_rows("rlvr", cfg.data.uri)
        prompts = pool.encode_prompts(rows)(cfg.worker_ready_timeout_s)
        result, _, _, _ = run_rlvr_on_engine(
            cfg,
            ctx,
            stage="post_training",
            base=policy,
            export_dir=workdir / "export",
            train=None,  # one replica group, as a stage without a train config runs it
            device="cpu",
            pool=pool,
            maker=RequestMaker(cfg, prompts, rows),
            pad_id=prompts.pad_id,
        )
    finally:
        pool.close()
    # The first event carries the sync of version 0 (the base folder: no put); an event
    # that repeats the one before it reports no newer sync.
    syncs = [s for (_, prev, _), (_, s, _) in itertools.pairwise(events) if s != prev]
    return result.summary, syncs, events[0][2] if events else float("nan")


def measure_resume(
    args: argparse.Namespace, policy: Path, task: dict[str, Path], tmp: Path
) -> float:
    """Stop after step 1 (its engine checkpoint complete), relaunch with the same
    workdir: seconds to the relaunch's first trained step."""
    workdir = tmp / "resume"
    run_id = f"bench-resume-{time.monotonic_ns()}"
    pids: list[int] = []
    with contextlib.suppress(Stop):
        run_once(
            2,
            args,
            policy,
            task,
            workdir,
            checkpoint_every=1,
            stop_after=1,
            warm=False,
            run_id=run_id,
            fleet_pids=pids,
        )
    # The relaunch names its actors as the first launch did: its ranks must be gone.
    deadline = time.monotonic() + ACTOR_TIMEOUT_S
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the first launch's ranks {pids} did not exit")
        time.sleep(0.05)
    t0 = time.perf_counter()
    summary, _, first = run_once(
        2, args, policy, task, workdir, checkpoint_every=1, warm=False, run_id=run_id
    )
    if summary.get("resumed_from_step") != 1.0:  # else it measured a fresh start
        raise RuntimeError(f"the relaunch did not resume at step 1: {summary}")
    return first - t0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
    from stages.trainer.fleet.engine import TrainingEngine

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
    from stages.post_training.config import RLVRConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument(
        "--max-dropped-groups",
        type=int,
        default=RLVRConfig.model_fields["max_dropped_groups_per_step"].default,
        help="dynamic sampling's uniform-reward groups dropped per step (default: the "
        "recipe's); a random policy's groups are nearly all uniform, each drop one "
        "more generation",
    )
    ap.add_argument("--learner-steps", type=int, default=8)
    # The replica-group counts whose learner rates are compared.
    ap.add_argument("--learner-groups", type=int, nargs="+", default=[1, 2])
    add_ray_address(ap)
    args = ap.parse_args()

    import ray

    from orchestrator.runtime.launch import use_scratch_launch_key
    from stages.post_training.synthetic import build_tiny_policy, write_task

    tmp = Path(tempfile.mkdtemp(prefix="bench-pt-"))
    use_scratch_launch_key(tmp)  # run by hand, no server holds one
    init_ray(args.ray_address, tmp / "ray", num_cpus=2)
    try:
        policy = build_tiny_policy(tmp / "policy", hidden=args.hidden, layers=2)
        task = write_task(tmp / "task", rl_numbers=tuple(range(10)))
        out: dict[int, dict[str, float]] = {}
        syncs: list[float] = []
        for eta in (0, 2):
            out[eta], s, _ = run_once(eta, args, policy, task, tmp / f"eta{eta}")
            syncs += s
            if eta == 2:
                syncs_object_store = s
        _, syncs_collective, _ = run_once(
            2, args, policy, task, tmp / "collective", weight_sync="collective"
        )
        resume_s = measure_resume(args, policy, task, tmp)
        learner = {g: learner_rate(args, policy, g, tmp) for g in args.learner_groups}
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
