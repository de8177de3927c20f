"""RLVR resume: a run interrupted after step k resumes from the newest saved state
(policy, optimizer, version, the fleet's request cursor), trains nothing older than
eta, and at eta = 0 ends with the same weights as a run that was never interrupted.

Real RolloutWorkers on threads (LocalPool); the interruption is an exception raised
from the run's event sink after step k, as a driver crash between steps would be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.waiting import wait_until

from orchestrator.runtime.ray_cluster import _alive
from stages.events import MetricsEvent
from stages.post_training.pools import LocalPool
from stages.post_training.resume import RESUME_DIR
from stages.trainer import replica_group_pids
from tests.post_training.test_fleet import _rl_setup


class Interrupted(Exception):
    pass


def _run(
    tiny_policy: Path,
    task_files: dict[str, Path],
    workdir: Path,
    *,
    eta: int,
    steps: int,
    every: int,
    stop_after: int | None = None,
) -> tuple[Any, Any, Any]:
    from stages.post_training.rl import run_rlvr

    cfg, learner, maker, make_worker = _rl_setup(tiny_policy, task_files, eta)
    cfg = cfg.model_copy(update={"steps": steps, "checkpoint_every_steps": every})
    learner.cfg = cfg

    def emit(e: Any) -> None:
        if stop_after is not None and isinstance(e, MetricsEvent) and e.step == stop_after:
            raise Interrupted(e.step)

    pool = LocalPool([make_worker(i) for i in range(2)])
    try:
        result, ctl = run_rlvr(cfg, learner, pool, maker, emit=emit, workdir=workdir)
    finally:
        pool.close()
    return result, ctl, learner


@pytest.mark.parametrize("eta", [0, 1])
def test_an_interrupted_run_resumes_at_the_newest_checkpoint_within_eta(
    tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path, eta: int
) -> None:
    steps, every, k = 6, 2, 3
    with pytest.raises(Interrupted):
        _run(tiny_policy, task_files, tmp_path, eta=eta, steps=steps, every=every, stop_after=k)
    saved = sorted(p.name for p in (tmp_path / RESUME_DIR).glob("step-*.pt"))
    assert saved == ["step-00000002.pt"]  # step 3 was trained but not saved

    result, ctl, learner = _run(
        tiny_policy, task_files, tmp_path, eta=eta, steps=steps, every=every
    )
    assert result.resumed_from == 2 and result.summary["resumed_from_step"] == 2.0
    assert result.steps == steps and learner.version == steps and len(result.rewards) == steps
    # The relaunch trained steps 2..5 only, every sample within eta of its step.
    assert sorted({s for s, _ in learner.trained}) == list(range(2, steps))
    assert all(s - v <= eta for s, v in learner.trained), learner.trained
    assert all(v >= 2 for _, v in learner.trained)  # nothing from before the resume
    assert max(ctl.stats.staleness) <= eta
    assert sorted(p.name for p in (tmp_path / RESUME_DIR).glob("step-*.pt")) == [
        "step-00000004.pt",
        "step-00000006.pt",
    ]

    if eta == 0:  # batches do not depend on timing: the same weights as one clean run
        _, _, clean = _run(tiny_policy, task_files, tmp_path / "clean", eta=0, steps=steps, every=0)
        a, b = clean.model.state_dict(), learner.model.state_dict()
        assert all(torch.equal(a[n], b[n]) for n in a)


def _engine_run(
    tiny_policy: Path,
    task_files: dict[str, Path],
    workdir: Path,
    *,
    eta: int,
    steps: int,
    every: int,
    stop_after: int | None = None,
    fleet_pids: list[int] | None = None,
) -> tuple[Any, Any, Path]:
    """The rlvr step as the stage runs it: the learner on the engine (one replica
    group, real Ray actors, DCP checkpoints), the fleet on threads."""
    from stages.base import StageContext
    from stages.post_training.hf_io import load_tokenizer
    from stages.post_training.learner import run_rlvr_on_engine

    cfg, _, maker, make_worker = _rl_setup(tiny_policy, task_files, eta)
    cfg = cfg.model_copy(update={"steps": steps, "checkpoint_every_steps": every})

    def emit(e: Any) -> None:
        if stop_after is not None and isinstance(e, MetricsEvent) and e.step == stop_after:
            if fleet_pids is not None:  # the engine's run id is the step's
                fleet_pids.extend(replica_group_pids(f"{ctx.run_id}-rlvr"))
            raise Interrupted(e.step)

    ctx = StageContext(run_id="rlvr-relaunch", booking_id="b", workdir=workdir, emit=emit)
    pool = LocalPool([make_worker(i) for i in range(2)])
    try:
        result, exported, learner, _ = run_rlvr_on_engine(
            cfg,
            ctx,
            stage="post_training",
            base=tiny_policy,
            export_dir=workdir / "export",
            train=None,
            device="cpu",
            pool=pool,
            maker=maker,
            pad_id=int(load_tokenizer(tiny_policy).pad_token_id),
        )
    finally:
        pool.close()
    return result, learner, exported


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_relaunched_driver_resumes_rlvr_on_the_engine_within_eta(
    ray_local: None, tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    """The driver dies after step 4 (its controller raises, the engine's actors are
    killed); a relaunch with the same workdir resumes at the engine's newest complete
    checkpoint, regenerates from the controller's state saved for it, and trains no
    sample older than eta for its step (the batch files are all the ranks train)."""
    from stages.checkpointing.storage import list_checkpoints

    steps, every, eta = 6, 2, 1
    pids: list[int] = []
    with pytest.raises(Interrupted):
        _engine_run(
            tiny_policy,
            task_files,
            tmp_path,
            eta=eta,
            steps=steps,
            every=every,
            stop_after=4,
            fleet_pids=pids,
        )
    # Killed actors may finish an async save in the moment before they exit: list the
    # checkpoints once no rank of the first launch is left to write one (one host).
    assert pids
    wait_until(lambda: not any(map(_alive, pids)), 60, "the first launch's ranks exit")
    ckpts = [r.step for r in list_checkpoints(tmp_path / "rlvr" / "checkpoints")]
    assert ckpts and ckpts[-1] in (2, 4), ckpts
    resumed = ckpts[-1]

    result, learner, exported = _engine_run(
        tiny_policy, task_files, tmp_path, eta=eta, steps=steps, every=every
    )
    assert result.resumed_from == resumed and result.steps == steps
    assert len(result.rewards) == steps and learner.version == steps
    assert sorted({s for s, _ in learner.trained}) == list(range(resumed, steps))
    assert all(s - v <= eta for s, v in learner.trained), learner.trained
    assert all(v >= resumed for _, v in learner.trained)  # nothing from before the resume
    assert (exported / "config.json").exists()
