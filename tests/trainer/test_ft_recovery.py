"""Live recovery with real process kills: torchft Lighthouse and Managers in Ray actors.

Nothing is mocked: a local Ray, torchft's Rust lighthouse, gloo process groups, and
``os.kill(pid, SIGKILL)`` of a replica group's worker process. Steps are paced
(``pace_step_s``) so that the tiny CPU model's run outlasts an actor restart.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers.stage_run import StageRun
from helpers.tiny_corpus import write_tiny_corpus
from helpers.waiting import wait_until

from stages.checkpointing.config import CheckpointPolicy
from stages.checkpointing.storage import read_log
from stages.events import (
    CheckpointEvent,
    FleetEvent,
    InterruptionEvent,
    ProposalEvent,
    StepEvent,
)
from stages.trainer.config import (
    LossSpikeConfig,
    LossSpikeInjection,
    ModelSpec,
    TrainingTarget,
    TrainStageConfig,
)
from stages.trainer.fleet.recovery import STANDBYS_PER_NODE, production_recovery

# Generous bounds on waiting for things that take seconds; never asserted as speed.
WAIT_S = 120.0
JOIN_TIMEOUT_S = 300.0
# A test waits on several events, then joins: its bounds add up past pytest's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _config(tmp: Path, *, standbys: int = STANDBYS_PER_NODE, **kw: object) -> TrainStageConfig:
    """The production recovery configuration of a one-node booking (``standbys`` warm
    standbys) around a paced llama-tiny run."""
    recovery = production_recovery({"node_count": 1}, standbys_per_node=standbys)
    base: dict[str, object] = dict(
        **recovery.train_fields(),
        model=ModelSpec(preset="llama-tiny", size="0.1M"),
        target=TrainingTarget(max_steps=150, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        checkpoint=CheckpointPolicy(interval_steps=10, keep=3, storage_uri=f"file://{tmp}/ckpt"),
        loss_spike=LossSpikeConfig(enabled=False),
        train_files=[str(write_tiny_corpus(tmp / "train.jsonl"))],
        replica_groups=2,
        pace_step_s=0.1,
    )
    base.update(kw)
    return TrainStageConfig.model_validate(base, strict=False)


def Run(cfg: TrainStageConfig, tmp: Path, run_id: str) -> StageRun:
    return StageRun(cfg, tmp, run_id, wait_s=WAIT_S, join_timeout_s=JOIN_TIMEOUT_S)


def test_kill_a_group_survivor_continues_and_restarted_group_heals(
    ray_local: None, tmp_path: Path
) -> None:
    # No standby left: every loss is Ray's restart of the actor (a new process). While
    # a group is missing the other steps at 0.5 s, so the run outlasts a restart however
    # slow the host, and ends soon after the group rejoined.
    cfg = _config(
        tmp_path,
        standbys=0,
        target=TrainingTarget(max_steps=150, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        pace_step_s=0.05,
        degraded_pace_step_s=0.5,
    )
    with Run(cfg, tmp_path, "ftkill") as run:
        _kill_and_recover(run, cfg)


def _kill_and_recover(run: StageRun, cfg: TrainStageConfig) -> None:
    from stages.trainer import kill_replica_groups

    # Every group lost at once: the run restarts from the newest complete checkpoint.
    run.wait_for(
        lambda e: isinstance(e, StepEvent) and e.committed and e.step >= 15 and e.quorum_size == 2,
        "15 steps in the full quorum",
    )
    last_before = max(e.step for e in run.steps() if e.committed)
    kill_all_at, pids = kill_replica_groups("ftkill", [0, 1])
    assert len(pids) == 2
    run.wait_for(
        lambda e: isinstance(e, InterruptionEvent) and e.interruption_kind == "all_groups_lost",
        "all-groups-lost recovery",
    )
    resumed = run.wait_for(
        lambda e: (
            isinstance(e, FleetEvent) and e.action == "checkpoint_restored" and e.ts > kill_all_at
        ),
        "checkpoint resume",
    )
    resumed_step = resumed.step
    assert 0 < resumed_step <= last_before and resumed.skipped_batches is None
    # No peer was left: the storage recorded the restart's checkpoint reads.
    assert [r for r in read_log(cfg.checkpoint.storage_path + "/ftkill") if r.at > kill_all_at], (
        "no checkpoint read recorded after every group died"
    )

    # Then one group: the survivor keeps committing, the restarted one heals and rejoins.
    run.wait_for(
        lambda e: (
            isinstance(e, StepEvent)
            and e.committed
            and e.quorum_size == 2
            and e.ts > kill_all_at
            and e.step >= resumed_step + 5
        ),
        "full quorum again",
    )
    killed_at = run.kill_group(1)  # the survivor commits alone
    # Group 1's loss reported after this kill (the restart above may itself have healed
    # the group that came back last from the one that came back first).
    rec = run.wait_for(
        lambda e: (
            isinstance(e, InterruptionEvent)
            and e.interruption_kind == "replica_group_lost"
            and e.replica_group == 1
            and e.ts > killed_at
        ),
        "recovery",
    )
    assert isinstance(rec, InterruptionEvent)
    assert rec.recovered_at is not None and rec.detected_at >= killed_at - 1.0, run.logs()
    assert rec.recovered_at > rec.detected_at  # recovered: healed from the live peer
    # Heal, don't reload: with a live peer the restarted group read no checkpoint.
    assert not [r for r in read_log(cfg.checkpoint.storage_path + "/ftkill") if r.at > killed_at]

    out = run.join()
    assert out.status == "passed", out.reason
    assert out.metrics["steps"] == cfg.target.steps
    assert out.metrics["interruptions"] >= 2
    # Tokens count each committed step once (its last report: both groups report every
    # step, and steps redone after the all-groups restart are reported again).
    last = {e.step: e.tokens for e in sorted(run.steps(), key=lambda e: e.ts) if e.committed}
    assert out.metrics["tokens"] == sum(last.values())
    assert out.metrics["tokens"] <= cfg.target.steps * cfg.target.global_batch_tokens
    after = [e for e in run.steps(1) if e.committed and e.ts > rec.recovered_at]
    assert any(e.quorum_size == 2 for e in after), "group 1 never rejoined the full quorum"
    # Both groups end bit-identical: the heal (weights, optimizer state, data position,
    # and the LR of the healed step) made group 1 an exact copy of the survivor.
    digests = out.artifacts["replica_digests"]
    assert set(digests) == {"0", "1"}
    assert digests["0"] == digests["1"]
    from stages.checkpointing.storage import list_checkpoints

    records = list_checkpoints(out.artifacts["checkpoint_dir"])
    assert records[-1].step == cfg.target.steps
    assert out.artifacts["final_checkpoint"] == records[-1].path


def test_loss_spike_waits_for_a_decision_declined_continues_approved_restarts(
    ray_local: None, tmp_path: Path
) -> None:
    first, second = 24, 44  # poisoned data batches (steps 25 and 45)
    cfg = _config(
        tmp_path,
        target=TrainingTarget(max_steps=60, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        loss_spike=LossSpikeConfig(window=10, z_threshold=6.0, min_steps=10, skip_window_steps=4),
        inject_loss_spike=LossSpikeInjection(batches=[first, second], scale=50.0),
        pace_step_s=0.02,
        standbys=0,
    )
    with Run(cfg, tmp_path, "ftspike") as run:
        _decline_then_approve(run, cfg, first, second)


# How long the test's "person" takes to decide on a proposal: the window in which
# nothing may move (an observation window, not a wait for anything to happen).
DECISION_DELAY_S = 3.0


def _paused_at(run: StageRun, step: int, proposed: ProposalEvent) -> float:
    """Decide only after DECISION_DELAY_S; returns the time of the decision, once the
    events show nothing moved in between: no step past the spike, no restore."""
    time.sleep(DECISION_DELAY_S)
    decided_at = time.time()
    held = [e for e in run.events if proposed.ts < e.ts < decided_at]
    assert max(e.step for e in run.steps() if e.committed and e.ts < decided_at) == step
    assert not [e for e in held if isinstance(e, StepEvent) and e.step > step], held
    assert not [
        e for e in held if isinstance(e, FleetEvent) and e.action == "checkpoint_restored"
    ], held
    return decided_at


def _decline_then_approve(run: StageRun, cfg: TrainStageConfig, first: int, second: int) -> None:
    p1 = run.wait_for(lambda e: isinstance(e, ProposalEvent), "the first proposal")
    assert isinstance(p1, ProposalEvent)
    assert p1.params["spike_step"] == first + 1 and p1.params["from_step"] == 20
    declined_at = _paused_at(run, first + 1, p1)
    run.ctx.decide(p1.proposal_id, "declined")

    # Declined: training continues from where it paused, no restore.
    p2 = run.wait_for(
        lambda e: isinstance(e, ProposalEvent) and e.proposal_id != p1.proposal_id,
        "the second proposal",
    )
    assert isinstance(p2, ProposalEvent)
    mid = [e for e in run.steps() if e.committed and declined_at < e.ts < p2.ts]
    assert min(e.step for e in mid) == first + 2
    ckpt = p2.params["from_step"]
    assert p2.params["spike_step"] == second + 1 and ckpt == 40 and p2.params["from_checkpoint"]
    # Steps 41..45 (batches 40..44, the poisoned one included) are skipped.
    assert p2.params["skip_batches"] == second + 1 - ckpt
    approved_at = _paused_at(run, second + 1, p2)
    run.ctx.decide(p2.proposal_id, "approved")
    out = run.join()
    assert out.status == "passed", out.reason
    restored = [
        e
        for e in run.events
        if isinstance(e, FleetEvent)
        and e.action == "checkpoint_restored"
        and e.step == ckpt
        and e.skipped_batches == (40, 45)
    ]
    assert {e.replica_group for e in restored} == set(range(cfg.replica_groups))
    assert len(restored) == cfg.replica_groups
    assert all(e.ts > approved_at for e in restored)
    after = [e for e in run.steps() if e.committed and e.ts > approved_at]
    # Every group trains again from the checkpoint's next step...
    assert min(e.step for e in after) == ckpt + 1
    # ...and the poisoned batch is skipped: no third spike.
    assert out.artifacts["proposals"] == [p1.proposal_id, p2.proposal_id]
    assert max(e.loss for e in after) < 20
    assert out.metrics["steps"] == cfg.target.steps
    assert any(
        isinstance(e, InterruptionEvent) and e.interruption_kind == "loss_spike" for e in run.events
    )


def test_cancel_kills_every_actor_of_the_run(ray_local: None, tmp_path: Path) -> None:
    import ray

    cfg = _config(tmp_path, replica_groups=1)
    with Run(cfg, tmp_path, "ftcancel") as run:
        run.wait_for(lambda e: isinstance(e, StepEvent) and e.committed, "a step")
        names = [n for n in ray.util.list_named_actors() if n.startswith("run-ftcancel-")]
        assert {
            "run-ftcancel-lighthouse",
            "run-ftcancel-trainer-rg0-rank0",
            "run-ftcancel-trainer-spare0-rank0",
        } <= set(names)
        run.ctx.cancel_event.set()
        out = run.join()
    assert out.status == "failed" and out.reason == "cancelled"
    wait_until(
        lambda: not any(n.startswith("run-ftcancel-") for n in ray.util.list_named_actors()),
        WAIT_S,
        "every actor of the cancelled run gone",
    )


def test_a_warm_spare_takes_a_lost_groups_place(ray_local: None, tmp_path: Path) -> None:
    """A pre-started spare steps in for a SIGKILLed group: it heals from the survivor,
    joins the full quorum as that group, and both end with identical weights."""
    import ray

    from stages.trainer import kill_replica_group
    from stages.trainer.rank.replica import worker_name

    # The standby warms up once the fleet trains (~10 s on 2 busy cores): 200 steps of
    # 0.1 s leave it time; once group 1 is lost the survivor steps at 0.5 s, so the run
    # outlasts the standby's activation and heal however slow the host.
    cfg = _config(
        tmp_path,
        target=TrainingTarget(max_steps=200, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        degraded_pace_step_s=0.5,
    )
    with Run(cfg, tmp_path, "ftspare") as run:
        run.wait_for(
            lambda e: (
                isinstance(e, StepEvent) and e.committed and e.step >= 10 and e.quorum_size == 2
            ),
            "10 steps in the full quorum",
        )
        run.wait_for(lambda e: isinstance(e, CheckpointEvent), "a checkpoint to reload from")
        run.wait_for(
            lambda e: isinstance(e, FleetEvent) and e.action == "standby_warm", "a warm standby"
        )
        # Each group runs on its own cores: a dead group's compute stays idle.
        cores = [
            ray.get(ray.get_actor(worker_name("ftspare", g, 0)).cores.remote(), timeout=WAIT_S)
            for g in range(2)
        ]
        assert cores[0] and cores[1]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not set(cores[0]) & set(cores[1]), cores
        killed_at, pids = kill_replica_group("ftspare", 1)
        assert pids
        took = run.wait_for(
            lambda e: (
                isinstance(e, FleetEvent)
                and e.action == "standby_activated"
                and e.replica_group == 1
            ),
            "the spare takes group 1's place",
        )
        assert took.ts > killed_at
        run.wait_for(
            lambda e: (
                isinstance(e, StepEvent)
                and e.committed
                and e.replica_group == 1
                and e.quorum_size == 2
                and e.ts > took.ts
            ),
            "group 1 back in the quorum",
        )
        out = run.join()
    assert out.status == "passed", out.reason
    # The standby took its weights and optimizer state from the peer: the storage
    # recorded no checkpoint read at all (a checkpoint existed before the kill).
    assert read_log(out.artifacts["checkpoint_dir"]) == []
    digests = out.artifacts["replica_digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]


def test_a_non_finite_step_is_refused_on_every_group_before_the_update(
    ray_local: None, tmp_path: Path
) -> None:
    """A poisoned batch makes step 21's loss infinite: no group commits it, so every
    group still holds exactly the weights of step 20 (its checkpoint's), and the
    spike proposal restarts from there, skipping the batch."""
    import math

    import ray

    from stages.checkpointing.seal import CheckpointBinding
    from stages.trainer.phase_eval import load_phase_model, sealed_checkpoint
    from stages.trainer.rank.replica import worker_name
    from stages.trainer.rank.shard_state import param_digest

    bad = 20  # the data batch of step 21
    cfg = _config(
        tmp_path,
        target=TrainingTarget(max_steps=30, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        loss_spike=LossSpikeConfig(window=10, min_steps=5, skip_window_steps=2),
        inject_loss_spike=LossSpikeInjection(batches=[bad], scale=math.inf),
        pace_step_s=0.02,
    )
    with Run(cfg, tmp_path, "ftnan") as run:
        p = run.wait_for(lambda e: isinstance(e, ProposalEvent), "the proposal")
        assert isinstance(p, ProposalEvent)
        assert p.params["non_finite"] and p.params["spike_step"] == bad + 1
        assert p.params["from_step"] == bad and p.params["from_checkpoint"]
        assert max(e.step for e in run.steps() if e.committed) == bad
        refused = [e for e in run.steps() if not e.committed and e.step == bad]
        assert {e.replica_group for e in refused} == {0, 1}
        digests = [
            ray.get(ray.get_actor(worker_name("ftnan", g, 0)).param_digest.remote(), timeout=WAIT_S)
            for g in range(cfg.replica_groups)
        ]
        from stages.checkpointing.storage import list_checkpoints

        [ckpt] = [r for r in list_checkpoints(tmp_path / "ckpt" / "ftnan") if r.step == bad]
        phase = cfg.schedule.phases[0]
        sealed = sealed_checkpoint(ckpt.path, CheckpointBinding(run_id="ftnan"), phase.name)
        ref = param_digest(load_phase_model(cfg, phase, sealed))
        assert [d["step"] for d in digests] == [bad, bad]
        assert [d["digest"] for d in digests] == [ref, ref]
        run.ctx.decide(p.proposal_id, "approved")
        out = run.join()
    assert out.status == "passed", out.reason
    assert out.metrics["steps"] == cfg.target.steps
    assert all(e.loss < 1e9 for e in run.steps() if e.committed)
    digests_end = out.artifacts["replica_digests"]
    assert digests_end["0"] == digests_end["1"]
