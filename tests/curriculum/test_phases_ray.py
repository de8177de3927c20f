"""Curriculum phases executed for real: a local Ray, torchft replica groups, a real
SIGKILL, real lm-eval batteries at each phase end, real HF exports.

Three phases (pretrain 32 → mid_train 32 → long_context 64 tokens). Phase 2's gate
cannot pass (held-out loss below 0.001), so the run must end ``eval_gate_failed``
after phase 2 and no step of phase 3 may ever run. A replica group is SIGKILLed in
phase 2 and must recover in phase 2.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.stage_run import StageRun
from helpers.tiny_corpus import write_tiny_corpus
from helpers.waiting import wait_until

from stages.base import GateOutcome
from stages.checkpointing.config import CheckpointPolicy
from stages.checkpointing.seal import CheckpointBinding, run_binding
from stages.checkpointing.storage import list_checkpoints, pinned_phase
from stages.curriculum.config import CurriculumConfig
from stages.curriculum.schedule import CurriculumSchedule, schedule_curriculum
from stages.errors import ErrorCode
from stages.events import (
    CheckpointEvent,
    EvalEvent,
    FleetEvent,
    InterruptionEvent,
    PhaseEvent,
    StepEvent,
)
from stages.trainer.config import LossSpikeConfig, ModelSpec, TrainingTarget, TrainStageConfig

WAIT_S = 180.0
# The module's run waits on several events of WAIT_S each: past pytest's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RUN_ID = "phases"
EXPORT_SHARD_BYTES = 64 << 10


CURRICULUM = CurriculumConfig.model_validate(
    {
        "phases": [
            {
                "name": "pretrain",
                "kind": "pretrain",
                "token_fraction": 0.1,
                "seq_len": 32,
                "gates": [{"metric": "heldout_loss", "max": 100.0}],
            },
            {
                "name": "mid",
                "kind": "mid_train",
                "token_fraction": 0.8,
                "lr_scale": 0.5,
                "warmup_steps": 2,
                "gates": [
                    {"metric": "heldout_loss", "max": 0.001},
                    {"metric": "heldout_bits_per_byte", "max_regression": 100.0},
                ],
            },
            {"name": "long", "kind": "long_context", "token_fraction": 0.1, "seq_len": 64},
        ]
    },
    strict=False,
)


def run_binding_of(run: Run) -> CheckpointBinding:
    """The binding the run's checkpoints are sealed for."""
    return run_binding(run.ctx.run_id, run.ctx.facts)


def _schedule() -> CurriculumSchedule:
    return schedule_curriculum(
        CURRICULUM,
        total_steps=100,
        base_seq_len=32,
        global_batch_tokens=256,
        learning_rate=1e-3,
        warmup_steps=3,
        rope_theta=10000.0,
        head_dim=16,
        max_positions=256,
    )


def _config(tmp: Path, *, replica_groups: int = 2, spare_groups: int = 1) -> TrainStageConfig:
    return TrainStageConfig.model_validate(
        dict(
            model=ModelSpec(preset="llama-tiny", size="0.1M"),
            target=TrainingTarget(
                max_steps=100,
                seq_len=32,
                global_batch_tokens=256,
                learning_rate=1e-3,
                warmup_steps=3,
            ),
            # keep=1: the checkpoint that closed pretrain must survive it anyway.
            checkpoint=CheckpointPolicy(interval_steps=5, keep=1, storage_uri=f"file://{tmp}/ckpt"),
            loss_spike=LossSpikeConfig(enabled=False),
            train_files=[str(write_tiny_corpus(tmp / "train.jsonl"))],
            # A warm spare takes a killed group's place at once: a new process would need
            # longer than phase 2 lasts on a loaded 2-core machine. While a group is
            # missing the survivor steps at 0.75 s, so phase 2 outlasts the heal.
            replica_groups=replica_groups,
            spare_groups=spare_groups,
            pace_step_s=0.25,
            degraded_pace_step_s=0.75,
            curriculum=_schedule(),
            # Small shard files: each phase's export has several, split over the ranks.
            evals={"export_shard_bytes": EXPORT_SHARD_BYTES},
        ),
        strict=False,
    )


class Run(StageRun):
    """The stage in a thread, plus the fleet's actor ids as the test saw them."""

    def __init__(self, cfg: TrainStageConfig, tmp: Path, run_id: str = RUN_ID):
        super().__init__(cfg, tmp / "work", run_id, wait_s=WAIT_S, join_timeout_s=WAIT_S)
        self.fleet_ids: list[dict[str, str]] = []
        self.fleet_seen_at = 0.0


@pytest.fixture(scope="module")
def failed_run(
    ray_local: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Run, GateOutcome, TrainStageConfig, float]]:
    from stages.trainer import kill_replica_group

    tmp = tmp_path_factory.mktemp("phases")
    cfg = _config(tmp)
    with Run(cfg, tmp) as run:
        run.wait_for(
            lambda e: isinstance(e, StepEvent) and e.committed and e.phase == "pretrain",
            "a phase 1 step",
        )
        run.fleet_ids.append(_fleet_ids())
        run.fleet_seen_at = time.time()
        # SIGKILL group 1 early in phase 2 (steps 10..90), so it is back well before 90.
        run.wait_for(
            lambda e: (
                isinstance(e, StepEvent)
                and e.committed
                and e.phase == "mid"
                and e.step >= 15
                and e.quorum_size == 2
            ),
            "phase 2 in the full quorum",
        )
        run.fleet_ids.append(_fleet_ids())
        # The standby warms up once the fleet trains: the kill must find it warm.
        run.wait_for(
            lambda e: isinstance(e, FleetEvent) and e.action == "standby_warm", "a warm standby"
        )
        killed_at, pids = kill_replica_group(RUN_ID, 1)
        assert pids
        out = run.join()
    yield run, out, cfg, killed_at


def _fleet_ids() -> dict[str, str]:
    """Ray actor id of the lighthouse and of every trainer actor of the run."""
    import ray

    from stages.trainer.fleet.lighthouse import lighthouse_name
    from stages.trainer.rank.replica import worker_name

    names = [lighthouse_name(RUN_ID), worker_name(RUN_ID, 0, 0), worker_name(RUN_ID, 1, 0)]
    return {n: ray.get_actor(n)._actor_id.hex() for n in names}


def test_the_fleet_stays_up_across_the_phase_boundary(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
) -> None:
    """Phases switch in place: the same lighthouse and trainer actors train phase 1
    and phase 2, started once (one start-up span per rank, none at the boundary)."""
    run, _, _, killed_at = failed_run
    in_pretrain, in_mid = run.fleet_ids
    first_mid = min(e.ts for e in run.events if isinstance(e, StepEvent) and e.phase == "mid")
    assert run.fleet_seen_at < first_mid  # the first look was in phase 1
    assert in_pretrain == in_mid
    started = [
        e for e in run.events if isinstance(e, FleetEvent) and e.action == "lighthouse_started"
    ]
    assert len(started) == 1
    from stages.trainer.fleet.lighthouse import lighthouse_name

    assert set(started[0].actors) == set(in_pretrain) - {lighthouse_name(RUN_ID)}
    startups = [
        e
        for e in run.events
        if isinstance(e, PhaseEvent) and e.phase == "startup" and e.ts < killed_at
    ]
    assert len(startups) == 2  # one per group's rank 0, before the kill


def test_second_gate_fails_the_run_and_phase_three_never_runs(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
) -> None:
    run, out, _, _ = failed_run
    assert out.status == "failed", out.reason
    assert out.error_code == ErrorCode.eval_gate_failed
    assert "phase mid" in out.reason and "heldout_loss" in out.reason
    [failing] = out.artifacts["failed_checks"]
    assert failing["check"] == "heldout_loss" and failing["max"] == 0.001
    assert failing["phase"] == "mid" and failing["score"] > 0.001
    steps = [e for e in run.events if isinstance(e, StepEvent)]
    assert steps and not [e for e in steps if e.phase == "long" or e.step > 90]
    assert max(e.step for e in steps if e.committed) == 90
    evals = [e for e in run.events if isinstance(e, EvalEvent)]
    assert {e.phase for e in evals} == {"pretrain", "mid"}
    assert all(e.passed for e in evals if e.phase == "pretrain")
    # Every check of the battery ran and scored, in both phases.
    assert {e.check for e in evals if e.phase == "mid" and e.score is not None} >= {
        "heldout_loss",
        "heldout_bits_per_byte",
        "gsm8k_exact_match",
        "arith_mc_acc",
    }
    regression = [
        e
        for e in evals
        if e.check == "heldout_bits_per_byte" and e.phase == "mid" and e.max_regression is not None
    ]
    assert regression and regression[0].previous is not None  # compared with pretrain
    assert [e for e in run.events if isinstance(e, PhaseEvent) and e.phase == "evaluation"]
    # The gate's verdict on the failing check, as an event of its own.
    assert [e for e in evals if e.phase == "mid" and e.check == "heldout_loss" and not e.passed]


def test_phases_train_with_their_own_seq_len_and_lr_schedule(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
) -> None:
    run, _, _, _ = failed_run
    schedule = _schedule()
    pre, mid = schedule.phases[0], schedule.phases[1]
    assert (pre.start_step, pre.end_step, mid.end_step) == (0, 10, 90)
    committed = [e for e in run.events if isinstance(e, StepEvent) and e.committed]
    for e in committed:
        phase = schedule.phase_of(e.step - 1)
        assert e.phase == phase.name
        assert e.seq_len == phase.seq_len
        assert e.lr == pytest.approx(phase.lr(e.step - 1))
    # The schedules differ: pretrain warms up to 1e-3; mid re-warms to half that and
    # decays (WSD) to 10% over its last 20% of steps (74..90).
    lrs = {e.step: e.lr for e in committed}
    assert lrs[1] == pytest.approx(1e-3 / 3) and lrs[5] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-4)  # pretrain's anneal ends at the floor
    assert lrs[11] == pytest.approx(0.5e-3 / 2) and lrs[20] == pytest.approx(0.5e-3)
    assert lrs[90] == pytest.approx(0.5e-4)
    assert lrs[82] < lrs[74] == pytest.approx(0.5e-3)


def test_group_killed_in_phase_two_recovers_in_phase_two(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
) -> None:
    run, out, _, killed_at = failed_run
    after = [e for e in run.events if isinstance(e, StepEvent) and e.ts > killed_at]
    assert after and all(e.phase == "mid" and e.seq_len == 32 for e in after)
    healed = [
        e
        for e in run.events
        if isinstance(e, InterruptionEvent)
        and e.replica_group == 1
        and e.detected_at > killed_at - 1.0
        and e.recovered_at is not None
    ]
    assert healed, [e for e in run.events if isinstance(e, InterruptionEvent)]
    rejoined = [e for e in after if e.replica_group == 1 and e.committed]
    assert rejoined and any(e.quorum_size == 2 for e in rejoined)
    assert out.metrics["interruptions"] >= 1


def test_phase_closing_checkpoints_are_kept_and_exported(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.trainer.phase_eval import load_phase_model, sealed_checkpoint

    run, out, cfg, _ = failed_run
    records = list_checkpoints(out.artifacts["checkpoint_dir"])
    by_step = {r.step: r for r in records}
    # keep=1, yet the checkpoints that closed pretrain (10) and mid (90) are both kept.
    assert pinned_phase(by_step[10]) == "pretrain" and pinned_phase(by_step[90]) == "mid"
    closing = [e for e in run.events if isinstance(e, CheckpointEvent) and e.closes_phase]
    assert [(e.step, e.phase) for e in closing] == [(10, "pretrain"), (90, "mid")]
    # Each phase's export reloads with from_pretrained and gives its checkpoint's logits.
    schedule = _schedule()
    for ph, summary in zip(schedule.phases[:2], out.artifacts["phases"], strict=True):
        export = Path(summary["export"])
        # Written by the ranks: both groups' ranks wrote safetensors shards of it.
        meta = json.loads((export / "ito_export.json").read_text())
        shards = sorted(p.name for p in export.glob("model-*.safetensors"))
        assert len(shards) >= 4 and sorted(meta["written_by"]) == shards
        assert set(meta["written_by"].values()) == {"rg0/rank0", "rg1/rank0"}, meta
        assert not list(export.parent.glob(f".{export.name}.tmp-*"))  # staging renamed
        model = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
        ids = torch.tensor([tok("doc 7: the quick brown fox")["input_ids"]])
        sealed = sealed_checkpoint(by_step[ph.end_step].path, run_binding_of(run), ph.name)
        ref = load_phase_model(cfg, ph, sealed)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_a_relaunched_stage_keeps_the_decided_gate(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A driver relaunch runs the stage again: decided gates are read back, nothing
    trains and nothing is re-scored; a failed gate stays failed."""
    run, out, cfg, _ = failed_run
    again = Run(cfg, Path(run.ctx.workdir).parent)
    out2 = again.join()
    assert out2.status == "failed" and out2.error_code == ErrorCode.eval_gate_failed
    assert out2.artifacts["failed_checks"] == out.artifacts["failed_checks"]
    assert not [e for e in again.events if isinstance(e, StepEvent | EvalEvent)]


def test_the_same_checkpoint_scores_identically_again(
    failed_run: tuple[Run, GateOutcome, TrainStageConfig, float],
) -> None:
    """Re-scoring the checkpoint that closed pretrain, in a fresh model, gives exactly
    the scores its gate recorded."""
    from stages.evals import run_battery
    from stages.hf import load_tokenizer
    from stages.trainer.phase_eval import load_phase_model, sealed_checkpoint
    from stages.trainer.phases import read_gate

    run, out, cfg, _ = failed_run
    pre = _schedule().phases[0]
    rec = read_gate(Path(out.artifacts["checkpoint_dir"]), pre)
    assert rec is not None
    work = Path(run.ctx.workdir)
    heldout = [
        json.loads(line)["text"]
        for line in (work / "phase_data" / "heldout.jsonl").read_text().splitlines()
    ]
    model = load_phase_model(
        cfg, pre, sealed_checkpoint(rec["checkpoint"], run_binding_of(run), pre.name)
    )
    again = run_battery(
        model,
        load_tokenizer(work / "tokenizer"),
        "smoke",
        heldout,
        seq_len=pre.seq_len,
        phase=pre.name,
    )
    assert again.scores() == {c["name"]: c["score"] for c in rec["result"]["checks"]}
    assert again.task_files == rec["result"]["task_files"]


def test_a_driver_relaunched_mid_phase_resumes_there(ray_local: None, tmp_path: Path) -> None:
    """The driver stops in phase 2 (every actor killed); a relaunched one reads phase
    1's decided gate back (no re-scoring) and resumes phase 2 at its newest checkpoint."""
    import ray

    # One group and no standby: nothing is killed here, so fewer trainer processes
    # (each a torch import) to start, twice.
    cfg, schedule = _config(tmp_path, replica_groups=1, spare_groups=0), _schedule()
    mid = schedule.phases[1]
    first = Run(cfg, tmp_path, "relaunch")
    first.wait_for(
        lambda e: (
            isinstance(e, CheckpointEvent) and e.phase == "mid" and e.step >= mid.start_step + 10
        ),
        "a phase 2 checkpoint",
    )
    first.ctx.cancel_event.set()
    assert first.join().reason == "cancelled"
    wait_until(
        lambda: not any(n.startswith("run-relaunch-") for n in ray.util.list_named_actors()),
        WAIT_S,
        "every actor of the stopped driver gone",
    )
    newest = list_checkpoints(tmp_path / "ckpt" / "relaunch")[-1].step
    assert mid.start_step < newest < mid.end_step

    again = Run(cfg, tmp_path, "relaunch")
    # Its first step follows the newest checkpoint, in phase 2 at phase 2's length.
    step = again.wait_for(lambda e: isinstance(e, StepEvent) and e.committed, "a step")
    assert isinstance(step, StepEvent)
    assert step.phase == "mid" and step.step == newest + 1 and step.seq_len == mid.seq_len
    again.ctx.cancel_event.set()
    again.join()
    # Phase 1's gate was decided by the first driver: not scored again.
    assert not [e for e in again.events if isinstance(e, EvalEvent) and e.phase == "pretrain"]
