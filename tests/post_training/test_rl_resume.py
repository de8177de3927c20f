"""RLVR resume: a run interrupted after step k resumes from the newest saved state
(policy, optimizer, version, the fleet's request cursor), trains nothing older than
eta, and at eta = 0 ends with the same weights as a run that was never interrupted;
on the engine, a learner group killed mid-step heals from its live peer.

Real RolloutWorkers on threads (LocalPool); the interruption is an exception raised
from the run's event sink after step k, as a driver crash between steps would be."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.rlvr_resume import RESUME_DIR
from helpers.waiting import wait_until

from orchestrator.runtime.ray_cluster import _alive
from stages.events import Event, InterruptionEvent, MetricsEvent, StepEvent
from stages.post_training.pools import LocalPool
from stages.trainer import replica_group_pids
from stages.trainer.config import TrainStageConfig
from tests.post_training.conftest import learner_layout
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
    train: TrainStageConfig | None = None,
    on_event: Callable[[Event], None] = lambda _e: None,
    run_id: str = "rlvr-relaunch",
) -> tuple[Any, Any, Path]:
    """The rlvr objective as the stage runs it: the learner on the engine (``train``'s
    replica groups, else one; real Ray actors, DCP checkpoints), the fleet on
    threads. ``on_event`` sees every event of the objective."""
    from stages.base import StageContext
    from stages.post_training.hf_io import load_tokenizer
    from stages.post_training.learner import run_rlvr_on_engine

    cfg, _, maker, make_worker = _rl_setup(tiny_policy, task_files, eta)
    cfg = cfg.model_copy(update={"steps": steps, "checkpoint_every_steps": every})

    def emit(e: Any) -> None:
        on_event(e)
        if stop_after is not None and isinstance(e, MetricsEvent) and e.step == stop_after:
            if fleet_pids is not None:  # the engine's run id is the objective's
                fleet_pids.extend(replica_group_pids(f"{ctx.run_id}-rlvr"))
            raise Interrupted(e.step)

    ctx = StageContext(run_id=run_id, booking_id="b", workdir=workdir, emit=emit)
    pool = LocalPool([make_worker(i) for i in range(2)])
    try:
        result, exported, learner, _ = run_rlvr_on_engine(
            cfg,
            ctx,
            stage="post_training",
            base=tiny_policy,
            export_dir=workdir / "export",
            train=train,
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_learner_group_killed_mid_rlvr_heals_from_its_peer_within_eta(
    ray_local: None, tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    """SIGKILL learner replica group 1 while the fleet feeds the engine: the survivor
    trains on, Ray restarts group 1, which heals from the live peer (reading no
    checkpoint) and rejoins the full quorum; the objective ends with every step trained
    once and no sample older than eta."""
    from stages.checkpointing.storage import read_log
    from stages.trainer import kill_replica_group

    # While group 1 is lost the survivor's steps take 1 s: the objective outlasts Ray's
    # restart of the group however slow the host, and ends soon after it rejoined.
    train = learner_layout(tmp_path, replica_groups=2, degraded_pace_step_s=1.0)
    steps, eta, kill_after = 60, 1, 5
    events: list[Event] = []
    killed: dict[str, Any] = {}

    def on_event(e: Event) -> None:
        events.append(e)
        if isinstance(e, MetricsEvent) and e.step == kill_after and not killed:
            killed["at"], killed["pids"] = kill_replica_group("rlvr-heal-rlvr", 1)

    result, learner, _ = _engine_run(
        tiny_policy,
        task_files,
        tmp_path,
        eta=eta,
        steps=steps,
        every=20,
        train=train,
        on_event=on_event,
        run_id="rlvr-heal",
    )
    assert killed["pids"], "group 1 had no live process to kill"
    healed = [
        e
        for e in events
        if isinstance(e, InterruptionEvent)
        and e.interruption_kind == "replica_group_lost"
        and e.replica_group == 1
        and e.detected_at >= killed["at"] - 1.0
    ]
    assert healed and healed[0].recovered_at is not None, healed
    back = [
        e
        for e in events
        if isinstance(e, StepEvent)
        and e.committed
        and e.replica_group == 1
        and e.quorum_size == 2
        and e.ts > healed[0].recovered_at
    ]
    assert back, "group 1 never trained in the full quorum again"
    # Healed from the live peer: the storage recorded no checkpoint read at all.
    assert read_log(tmp_path / "rlvr" / "checkpoints") == []
    assert result.steps == steps and learner.version == steps
    assert sorted({s for s, _ in learner.trained}) == list(range(steps))
    assert all(s - v <= eta for s, v in learner.trained), learner.trained
