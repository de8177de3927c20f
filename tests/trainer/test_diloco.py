"""DiLoCo across replica groups on the real engine: torchft's ``DiLoCo`` in each rank's
loop, a real local Ray, torchft's lighthouse and Managers, gloo, and a real SIGKILL of a
group's process in the middle of a turn. Steps are paced (``pace_step_s``) so that a
turn outlasts the kill and the restart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers.stage_run import StageRun
from helpers.tiny_corpus import write_tiny_corpus

from stages.checkpointing.config import CheckpointPolicy
from stages.checkpointing.storage import delete_checkpoint, list_checkpoints
from stages.curriculum.config import CurriculumConfig
from stages.curriculum.schedule import CurriculumSchedule, schedule_curriculum
from stages.events import (
    CheckpointEvent,
    EvalEvent,
    FleetEvent,
    InterruptionEvent,
    LogEvent,
    StepEvent,
)
from stages.replica_sync import ReplicaSync
from stages.trainer.config import LossSpikeConfig, ModelSpec, TrainingTarget, TrainStageConfig
from stages.trainer.parallel.layout import ParallelLayout

WAIT_S = 120.0
JOIN_TIMEOUT_S = 300.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYNC_EVERY = 5


def _config(tmp: Path, **kw: object) -> TrainStageConfig:
    base: dict[str, object] = dict(
        model=ModelSpec(preset="llama-tiny", size="0.1M"),
        target=TrainingTarget(max_steps=40, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        checkpoint=CheckpointPolicy(interval_steps=10, keep=3, storage_uri=f"file://{tmp}/ckpt"),
        loss_spike=LossSpikeConfig(enabled=False),
        train_files=[str(write_tiny_corpus(tmp / "train.jsonl"))],
        replica_groups=2,
        sync=ReplicaSync(mode="diloco", sync_every=SYNC_EVERY),
    )
    base.update(kw)
    return TrainStageConfig.model_validate(base, strict=False)


def _shares(run: StageRun) -> Counter[tuple[int, int]]:
    """(step, place among the step's member groups) of every committed report."""
    return Counter(
        (e.step, e.batch_share[0]) for e in run.steps() if e.committed and e.batch_share is not None
    )


def _two_phases(steps: int) -> CurriculumSchedule:
    """pretrain then mid_train, half the steps each, each with a gate that passes."""
    curriculum = CurriculumConfig.model_validate(
        {
            "phases": [
                {
                    "name": name,
                    "kind": kind,
                    "token_fraction": 0.5,
                    "gates": [{"metric": "heldout_loss", "max": 100.0}],
                }
                for name, kind in (("pretrain", "pretrain"), ("mid", "mid_train"))
            ]
        },
        strict=False,
    )
    return schedule_curriculum(
        curriculum,
        total_steps=steps,
        base_seq_len=32,
        global_batch_tokens=256,
        learning_rate=3e-4,
        warmup_steps=5,
        rope_theta=10000.0,
        head_dim=16,
        max_positions=256,
    )


def test_a_diloco_run_trains_in_turns_through_its_phases_and_resumes_exactly(
    ray_local: None, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, curriculum=_two_phases(40))
    with StageRun(cfg, tmp_path, "diloco", wait_s=WAIT_S, join_timeout_s=JOIN_TIMEOUT_S) as run:
        out = run.join()
    assert out.status == "passed", out.reason
    assert out.metrics["steps"] == cfg.target.steps
    # Each phase ends at a sync, where its gate judges the weights every group shares,
    # and the next phase goes on in place.
    gates = [e for e in run.events if isinstance(e, EvalEvent) and e.check == "heldout_loss"]
    assert [(g.phase, g.passed) for g in gates] == [("pretrain", True), ("mid", True)]
    assert {e.phase for e in run.steps() if e.committed} == {"pretrain", "mid"}
    # Every step of every turn is reported once by each group, with its own share.
    assert _shares(run) == Counter(
        {(s, place): 1 for s in range(1, cfg.target.steps + 1) for place in (0, 1)}
    )
    steps = [e for e in run.steps() if e.committed]
    assert {e.quorum_size for e in steps} == {2}
    assert out.metrics["tokens"] == cfg.target.steps * cfg.target.global_batch_tokens
    # The outer steps keep the groups together: equal weights at the end.
    digests = out.artifacts["replica_digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]
    # Each group reports its own inner steps' loss (every_step reports the groups' mean).
    by_step: dict[int, set[float]] = {}
    for e in steps:
        by_step.setdefault(e.step, set()).add(e.loss)
    assert any(len(losses) == 2 for losses in by_step.values())

    # A resume: every group starts from the saving group's checkpoint, and the outer
    # state (the weights at the last sync, the outer momentum) is in it, each FSDP2
    # rank's shard of it under one key.
    _resumes_exactly(
        tmp_path, ranks_per_group=2, parallel=ParallelLayout(dp_shard=2), worker_num_cpus=0.25
    )


def _resumes_exactly(tmp_path: Path, **kw: object) -> None:
    """One group's DiLoCo run (``kw``: its layout), stopped after a checkpoint and
    started again, ends with the uninterrupted run's weights bit for bit: the checkpoint
    holds the outer state (the weights at the last sync, the outer momentum) as well as
    the inner one. (With more groups the checkpoint holds the saving group's inner
    optimizer state, which every group then starts from: their inner moments differed.)"""
    digests = []
    for name in ("whole", "stopped"):
        workdir = tmp_path / name
        workdir.mkdir()
        pace = 0.05 if name == "stopped" else 0
        target = TrainingTarget(max_steps=20, seq_len=32, global_batch_tokens=256, warmup_steps=5)
        cfg = _config(workdir, replica_groups=1, pace_step_s=pace, target=target, **kw)
        if name == "stopped":
            with StageRun(cfg, workdir, name, wait_s=WAIT_S, join_timeout_s=JOIN_TIMEOUT_S) as run:
                run.wait_for(
                    lambda e: isinstance(e, CheckpointEvent) and e.step == 2 * SYNC_EVERY,
                    "the checkpoint of the second sync",
                )
            for record in list_checkpoints(f"{cfg.checkpoint.storage_path}/{name}"):
                if record.step > 2 * SYNC_EVERY:  # resume from that one
                    delete_checkpoint(record)
        with StageRun(cfg, workdir, name, wait_s=WAIT_S, join_timeout_s=JOIN_TIMEOUT_S) as run:
            out = run.join()
        assert out.status == "passed", out.reason
        restored = [e for e in run.events if isinstance(e, FleetEvent)]
        restored = [e.step for e in restored if e.action == "checkpoint_restored"]
        assert restored == ([2 * SYNC_EVERY] if name == "stopped" else [])
        digests.append(out.artifacts["replica_digests"]["0"])
    assert digests[0] == digests[1]


def test_a_group_killed_mid_turn_heals_at_the_next_sync_and_every_token_counts_once(
    ray_local: None, tmp_path: Path
) -> None:
    from stages.checkpointing.storage import read_log
    from stages.trainer.fleet.recovery import STANDBYS_PER_NODE, production_recovery

    # The recovery production launches for a one-node booking: a warm standby group
    # takes the lost group's place. While a group is missing the other paces its steps
    # at 0.3 s, so the run outlasts the activation however slow the host.
    recovery = production_recovery({"node_count": 1}, standbys_per_node=STANDBYS_PER_NODE)
    cfg = _config(
        tmp_path,
        **recovery.train_fields(),
        target=TrainingTarget(max_steps=100, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        pace_step_s=0.05,
        degraded_pace_step_s=0.3,
    )
    assert cfg.spare_groups == 1
    with StageRun(cfg, tmp_path, "dlkill", wait_s=WAIT_S, join_timeout_s=JOIN_TIMEOUT_S) as run:
        run.wait_for(
            lambda e: isinstance(e, StepEvent) and e.committed and e.step >= 12,
            "two turns in the full quorum",
        )
        # The turn after a reported sync is under way: the kill lands mid-turn, and the
        # survivor's turns then commit alone.
        killed_at = run.kill_group(1)
        rec = run.wait_for(
            lambda e: (
                isinstance(e, InterruptionEvent)
                and e.interruption_kind == "replica_group_lost"
                and e.replica_group == 1
                and e.recovered_at is not None
            ),
            "group 1 back in the quorum",
        )
        out = run.join()
    assert out.status == "passed", out.reason
    assert out.metrics["steps"] == cfg.target.steps
    # Healed at a sync from its live peer: no checkpoint read after the kill.
    assert any(
        isinstance(e, LogEvent) and e.message.startswith("rg1: healed from a live peer")
        for e in run.events
        if e.ts > killed_at
    ), run.logs()
    assert not [r for r in read_log(cfg.checkpoint.storage_path + "/dlkill") if r.at > killed_at]
    after = [e for e in run.steps(1) if e.committed and e.ts > rec.recovered_at]
    assert after and all(e.quorum_size == 2 for e in after)
    # Every token once: no share of a step is reported twice (the killed group's turn
    # in flight was never reported, the survivor's turns alone carry its share only),
    # and the run's token count is the trainers each step's sync counted.
    shares = _shares(run)
    assert max(shares.values()) == 1
    assert {s for s, _ in shares} == set(range(1, cfg.target.steps + 1))
    per_share = cfg.target.global_batch_tokens // cfg.replica_groups
    tokens = {e.step: e.tokens for e in sorted(run.steps(), key=lambda e: e.ts) if e.committed}
    assert out.metrics["tokens"] == sum(tokens.values())
    reported = Counter(step for step, _ in shares)
    assert any(reported[s] == 1 for s in tokens), "no turn trained by the survivor alone"
    # Steps counted with more trainers than reports: only the killed group's last turn,
    # synced (it trained it) before its reports of it died with its process.
    unreported = [s for s, t in tokens.items() if t // per_share != reported[s]]
    assert all(tokens[s] // per_share == reported[s] + 1 for s in unreported)
    assert len({(s - 1) // SYNC_EVERY for s in unreported}) <= 1, unreported
    trained_at = {e.step: e.ts for e in run.steps() if e.committed}
    assert all(trained_at[s] < killed_at for s in unreported), unreported
    digests = out.artifacts["replica_digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]
