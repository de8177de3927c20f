"""A running run follows its booking: it grows by a replica group and shrinks back, live.

Nothing is mocked: a local Ray, torchft's lighthouse and Managers, gloo. The booking's
size change is the ``ResizeRequest`` the orchestrator puts in the run's inbox
(``stages.resize``). The run's token ledger is its groups' ``batch_share`` reports: each
committed step's global batch must be cut into exactly one share per member group.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers.stage_run import StageRun

from stages.checkpointing.config import CheckpointPolicy
from stages.events import CheckpointEvent, FleetEvent, LogEvent, ResizeEvent, StepEvent
from stages.resize import ResizeRequest
from stages.trainer.config import LossSpikeConfig, ModelSpec, TrainingTarget, TrainStageConfig
from stages.trainer.fleet.recovery import production_recovery

WAIT_S = 180.0
JOIN_TIMEOUT_S = 300.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 240


def _data(path: Path) -> Path:
    with path.open("w") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"doc {i}: " + "a lazy dog jumps " * (i % 7 + 1)}) + "\n")
    return path


def _config(
    tmp: Path,
    *,
    pace_step_s: float,
    steps: int = STEPS,
    replica_groups: int = 2,
    standbys: int = 0,
) -> TrainStageConfig:
    # 12 sequences a step: 6 a group at 2 groups, 4 at 3.
    tmp.mkdir(parents=True, exist_ok=True)
    return TrainStageConfig.model_validate(
        dict(
            **production_recovery({"node_count": 1}, standbys_per_node=standbys).train_fields(),
            model=ModelSpec(preset="llama-tiny", size="0.1M"),
            target=TrainingTarget(
                max_steps=steps, seq_len=32, global_batch_tokens=384, warmup_steps=5
            ),
            checkpoint=CheckpointPolicy(
                interval_steps=20, keep=2, storage_uri=f"file://{tmp}/ckpt"
            ),
            loss_spike=LossSpikeConfig(enabled=False),
            train_files=[str(_data(tmp / "train.jsonl"))],
            replica_groups=replica_groups,
            pace_step_s=pace_step_s,
        ),
        strict=False,
    )


def _ledger(run: StageRun) -> dict[int, dict[int, tuple[int, int]]]:
    """step -> {group: (its place, members)} of every committed step (a redone step's
    last report wins)."""
    ledger: dict[int, dict[int, tuple[int, int]]] = {}
    for e in run.steps():
        if e.committed and e.batch_share is not None:
            ledger.setdefault(e.step, {})[e.replica_group] = e.batch_share
    return ledger


def _assert_every_batch_once(
    ledger: dict[int, dict[int, tuple[int, int]]], steps: int, *context: object
) -> None:
    """Each committed step's global batch went out in exactly one share per member group."""
    assert sorted(ledger) == list(range(1, steps + 1)), context
    for step, shares in ledger.items():
        members = {m for _, m in shares.values()}
        assert len(members) == 1, (step, shares, *context)
        (count,) = members
        assert sorted(place for place, _ in shares.values()) == list(range(count)), (
            step,
            shares,
            *context,
        )


def _resize(
    run: StageRun, request_id: str, groups: int, *, until: str = "applied", **kw: object
) -> ResizeEvent:
    run.ctx.resize_inbox.put(
        ResizeRequest(request_id=request_id, replica_groups=groups, requested_at=time.time(), **kw)
    )
    applied: ResizeEvent = run.wait_for(
        lambda e: (
            isinstance(e, ResizeEvent)
            and e.request_id == request_id
            and e.action in (until, "refused")
        ),
        f"resize {request_id}",
    )
    assert applied.action == until, applied.reason
    return applied


def test_a_run_grows_shrinks_pauses_and_resumes_with_every_sequence_trained_once(
    ray_local: None, tmp_path: Path
) -> None:
    cfg = _config(tmp_path / "elastic", pace_step_s=0.1)
    with StageRun(cfg, tmp_path / "elastic", "elastic", wait_s=WAIT_S, join_timeout_s=900) as run:
        run.wait_for(lambda e: isinstance(e, StepEvent) and e.committed and e.step >= 5, "step 5")
        grow = _resize(run, "grow", 3)
        # An original group leaves: the batch is then shared by groups 0 and 2.
        shrink = _resize(run, "shrink", 2, leaving_groups=(1,))
        # The booking no longer holds a group: the run checkpoints and waits, then
        # resumes on two new groups from that checkpoint when capacity is back.
        pause = _resize(run, "pause", 0, until="paused")
        resume = _resize(run, "resume", 2)
        out = run.join()
    assert out.status == "passed", out.reason
    assert (grow.groups_before, grow.groups_after) == (2, 3)
    assert (shrink.groups_before, shrink.groups_after) == (3, 2)
    assert grow.step is not None and shrink.step is not None and grow.step < shrink.step
    assert (pause.groups_before, pause.groups_after) == (2, 0)
    assert pause.step is not None and shrink.step <= pause.step
    assert (resume.groups_before, resume.groups_after) == (0, 2)

    # The ledger: every step's batch went out in exactly one share per member group.
    ledger = _ledger(run)
    resizes = [(e.request_id, e.step) for e in (grow, shrink, pause, resume)]
    _assert_every_batch_once(ledger, STEPS, resizes)
    for step, shares in ledger.items():
        if step < grow.step - 1:
            assert set(shares) == {0, 1}, (step, shares)
        if shrink.step <= step <= pause.step:
            assert set(shares) == {0, 2}, (step, shares)
        if step > pause.step:
            assert set(shares) == {3, 4}, (step, shares)
    assert any(set(s) == {0, 1, 2} for s in ledger.values())
    # The global batch stayed fixed: every step trained the same tokens.
    assert out.metrics["tokens"] == STEPS * cfg.target.global_batch_tokens

    # The new group healed from a live peer: it read no checkpoint; the resumed groups
    # read the pause's.
    restored = [
        e for e in run.events if isinstance(e, FleetEvent) and e.action == "checkpoint_restored"
    ]
    assert {(e.replica_group, e.step) for e in restored} == {(3, pause.step), (4, pause.step)}
    assert any(
        isinstance(e, LogEvent) and e.message.startswith("rg2: healed from a live peer")
        for e in run.events
    )
    drained = [e for e in run.events if isinstance(e, FleetEvent) and e.action == "groups_drained"]
    assert [e.replica_group for e in drained] == [1]

    # The same loss as a run that never resized (the same tokens, the same order).
    cfg_still = _config(tmp_path / "still", pace_step_s=0.0)
    with StageRun(cfg_still, tmp_path / "still", "still", wait_s=WAIT_S, join_timeout_s=900) as ref:
        still = ref.join()
    assert still.status == "passed", still.reason
    assert abs(out.metrics["final_loss"] - still.metrics["final_loss"]) < 1e-3 * abs(
        still.metrics["final_loss"]
    ), (out.metrics["final_loss"], still.metrics["final_loss"])


# Paced (0.15 s a step) so the run outlasts the grow: the new group's process starts and
# builds its model while the one group trains on.
GROW_FROM_ONE_STEPS = 150


def test_a_run_down_to_one_group_grows_back_with_every_sequence_trained_once(
    ray_local: None, tmp_path: Path
) -> None:
    # The grow from one live group: its last quorums had a single member, and the new
    # group heals in the quorum of the held step while the step after is the first its
    # members share.
    cfg = _config(tmp_path / "regrow", pace_step_s=0.15, steps=GROW_FROM_ONE_STEPS)
    with StageRun(cfg, tmp_path / "regrow", "regrow", wait_s=WAIT_S, join_timeout_s=900) as run:
        run.wait_for(lambda e: isinstance(e, StepEvent) and e.committed and e.step >= 3, "step 3")
        shrink = _resize(run, "to-one", 1, leaving_groups=(0,))
        grow = _resize(run, "back-to-two", 2)
        out = run.join()
    assert out.status == "passed", out.reason
    assert (shrink.groups_before, shrink.groups_after) == (2, 1)
    assert (grow.groups_before, grow.groups_after) == (1, 2)
    assert shrink.step is not None and grow.step is not None and shrink.step < grow.step

    ledger = _ledger(run)
    _assert_every_batch_once(ledger, GROW_FROM_ONE_STEPS, shrink.step, grow.step)
    for step, shares in ledger.items():
        if shrink.step < step < grow.step - 1:
            assert set(shares) == {1}, (step, shares)
        if step >= grow.step:
            assert set(shares) == {1, 2}, (step, shares)
    assert out.metrics["tokens"] == GROW_FROM_ONE_STEPS * cfg.target.global_batch_tokens
    # The new group healed from the one live peer: it read no checkpoint.
    assert not any(
        isinstance(e, FleetEvent) and e.action == "checkpoint_restored" for e in run.events
    )
    assert any(
        isinstance(e, LogEvent) and e.message.startswith("rg2: healed from a live peer")
        for e in run.events
    )


# Paced so the one group outlasts the grow (two launches of the new group: process
# start and model build each); as few steps as that allows.
GROW_PLANNED_ONE_STEPS = 160


def test_a_run_planned_at_one_group_grows_to_two_past_a_new_group_lost_while_it_builds(
    ray_local: None, tmp_path: Path
) -> None:
    # The booking gained a node: a run planned, launched and trained at one group (a
    # lighthouse, a membership and a batch cut that only ever knew one member) grows
    # to two, the new group healing from the one live group. The first new group's
    # process is SIGKILLed while it builds: the grow launches a fresh one (group 2).
    from stages.trainer import kill_replica_group

    cfg = _config(
        tmp_path / "one", pace_step_s=0.15, steps=GROW_PLANNED_ONE_STEPS, replica_groups=1
    )
    with StageRun(cfg, tmp_path / "one", "planned-one", wait_s=WAIT_S, join_timeout_s=900) as run:
        run.wait_for(lambda e: isinstance(e, StepEvent) and e.committed and e.step >= 3, "step 3")
        run.ctx.resize_inbox.put(
            ResizeRequest(
                request_id="one-to-two",
                replica_groups=2,
                requested_at=time.time(),
                nodes=("n0", "n1"),
            )
        )
        deadline = time.monotonic() + WAIT_S
        while not kill_replica_group(run.ctx.run_id, 1)[1]:  # its actor is up: it builds
            assert time.monotonic() < deadline, "the new group's rank never came up"
            time.sleep(0.05)
        grow = run.wait_for(
            lambda e: isinstance(e, ResizeEvent) and e.action in ("applied", "refused"),
            "the grow applied",
        )
        out = run.join()
    assert out.status == "passed", out.reason
    assert (grow.action, grow.groups_before, grow.groups_after) == ("applied", 1, 2), grow.reason
    assert grow.step is not None
    assert any(
        isinstance(e, LogEvent) and "the new groups start again (launch 2 of 3)" in e.message
        for e in run.events
    ), run.logs()

    ledger = _ledger(run)
    _assert_every_batch_once(ledger, GROW_PLANNED_ONE_STEPS, grow.step)
    for step, shares in ledger.items():
        if step < grow.step - 1:
            assert set(shares) == {0}, (step, shares)
        if step >= grow.step:
            assert set(shares) == {0, 2}, (step, shares)
    # The run ends with two groups: both trained its last step.
    assert set(ledger[GROW_PLANNED_ONE_STEPS]) == {0, 2}
    assert out.metrics["tokens"] == GROW_PLANNED_ONE_STEPS * cfg.target.global_batch_tokens
    # The new group healed from the live one: it read no checkpoint (one was saved).
    assert not any(
        isinstance(e, FleetEvent) and e.action == "checkpoint_restored" for e in run.events
    )
    assert any(
        isinstance(e, LogEvent) and e.message.startswith("rg2: healed from a live peer")
        for e in run.events
    )


# Paced so the run outlasts its standby's warm-up, a saved checkpoint and the grow.
GROW_BY_STANDBY_STEPS = 200


def test_a_grow_promotes_the_warm_standby_which_heals_with_every_sequence_trained_once(
    ray_local: None, tmp_path: Path
) -> None:
    # The run keeps a warm standby: the grow makes it the new group (nothing is
    # launched), activated at the held step; it heals from a live peer although a
    # checkpoint was saved (its peers hold: none trains when it joins).
    cfg = _config(tmp_path / "promote", pace_step_s=0.15, steps=GROW_BY_STANDBY_STEPS, standbys=1)
    with StageRun(cfg, tmp_path / "promote", "promote", wait_s=WAIT_S, join_timeout_s=900) as run:
        warm = run.wait_for(
            lambda e: isinstance(e, FleetEvent) and e.action == "standby_warm", "a warm standby"
        )
        run.wait_for(lambda e: isinstance(e, CheckpointEvent), "a checkpoint")
        grow = _resize(run, "grow", 3)
        out = run.join()
    assert out.status == "passed", out.reason
    assert (grow.groups_before, grow.groups_after) == (2, 3) and grow.step is not None

    # The new group 2 is the standby's process: promoted, not launched.
    (spare,) = warm.actors
    fleet = [e for e in run.events if isinstance(e, FleetEvent)]
    assert [(e.replica_group, e.actors) for e in fleet if e.action == "standby_activated"] == [
        (2, [spare])
    ]
    assert [(e.replica_group, e.actors) for e in fleet if e.action == "groups_added"] == [
        (2, [spare])
    ]
    assert any(
        isinstance(e, LogEvent) and f"standby {spare} becomes replica group 2" in e.message
        for e in run.events
    )

    ledger = _ledger(run)
    _assert_every_batch_once(ledger, GROW_BY_STANDBY_STEPS, grow.step)
    for step, shares in ledger.items():
        if step < grow.step - 1:
            assert set(shares) == {0, 1}, (step, shares)
        if step >= grow.step:
            assert set(shares) == {0, 1, 2}, (step, shares)
    assert out.metrics["tokens"] == GROW_BY_STANDBY_STEPS * cfg.target.global_batch_tokens
    # It healed from a live peer and read no checkpoint.
    assert not any(e.action == "checkpoint_restored" for e in fleet)
    assert any(
        isinstance(e, LogEvent) and e.message.startswith("rg2: healed from a live peer")
        for e in run.events
    )
