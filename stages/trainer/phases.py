"""Curriculum phases, executed: one engine run follows the whole schedule; at each
phase's end the fleet waits while the phase's closing checkpoint is kept, its eval
battery runs, it is exported in HF format, and its gate decides.

The fleet (lighthouse, trainer actors, process groups, Managers, model, optimizer)
stays up across phase boundaries; the ranks switch sequence length, data mix, LR
schedule and RoPE base in place (``TrainLoop.enter_phase``). A phase's gate result
is written beside its checkpoints before the next phase trains, so a relaunched
driver skips passed phases, resumes the unfinished one at its step, and never
re-scores a decided gate: a failed gate stays failed. Nothing overrides it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from stages.atomic_write import write_text
from stages.base import GateOutcome, StageContext
from stages.checkpointing.seal import run_binding
from stages.checkpointing.storage import list_checkpoints, pin_phase, pinned_phase
from stages.curriculum.schedule import PhaseSpan
from stages.errors import ErrorCode, ItoError
from stages.events import CheckpointEvent, LogEvent, PhaseEvent
from stages.trainer.config import TrainStageConfig
from stages.trainer.parallel.layout import BuiltLayout
from stages.trainer.rank.phase_data import PhaseData

if TYPE_CHECKING:
    from stages.checkpointing.storage import CheckpointRecord
    from stages.evals import BatteryResult, GateDecision
    from stages.trainer.fleet.engine import TrainingEngine

STAGE = "train"


def gate_path(ckpt_dir: Path, phase: PhaseSpan) -> Path:
    return ckpt_dir / "phases" / f"{phase.index:02d}-{phase.name}.json"


class GateRecord(TypedDict):
    """A phase's decided gate, as written beside its checkpoints (``gate_path``)."""

    phase: str
    index: int
    checkpoint: str
    step: int
    export: str | None  # the phase's HF export
    eval_seconds: float
    result: dict[str, Any]  # the BatteryResult, as JSON
    decision: dict[str, Any]  # the GateDecision, as JSON


class PhaseSummary(TypedDict):
    """A decided phase in the stage's outcome (``artifacts["phases"]``)."""

    phase: str
    kind: str
    steps: list[int]
    seq_len: int
    battery: str | None
    checkpoint: str
    export: str | None
    passed: bool
    scores: dict[str, float | None]
    gates: list[dict[str, Any]]  # the decision's checks, as JSON


def read_gate(ckpt_dir: Path, phase: PhaseSpan) -> GateRecord | None:
    p = gate_path(ckpt_dir, phase)
    record: GateRecord | None = json.loads(p.read_text()) if p.is_file() else None
    return record


def _write_json(path: Path, data: Mapping[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=1, sort_keys=True))


class CurriculumRunner:
    def __init__(self, cfg: TrainStageConfig, ctx: StageContext, ckpt_dir: Path):
        self.cfg = cfg
        self.schedule = cfg.schedule
        self.ctx = ctx
        self.ckpt_dir = ckpt_dir
        self.data: PhaseData | None = None  # the run's data, once it is prepared
        self.steps = 0
        self.tokens = 0
        self.interruptions = 0
        self.final_loss: float | None = None
        self.proposals: list[str] = []
        self.digests: dict[int, str] = {}
        self.rank_digests: dict[str, str] = {}
        self.layout: BuiltLayout | None = None  # rank 0's, as the engine kept it
        self.phases: list[PhaseSummary] = []
        self._previous: BatteryResult | None = None  # the last decided phase's
        self._failed: GateDecision | None = None
        self.engine: TrainingEngine | None = None

    @property
    def _tokenizer_dir(self) -> Path:
        assert self.data is not None, "run() is given the data"
        return self.data.tokenizer_dir

    def log(
        self, message: str, level: Literal["debug", "info", "warning", "error"] = "info"
    ) -> None:
        self.ctx.emit(LogEvent(stage=STAGE, level=level, message=message))

    def first_undecided(self) -> PhaseSpan | None:
        """The phase training resumes in: the first without a gate record, unless an
        earlier decided gate failed (then nothing trains)."""
        for phase in self.schedule.phases:
            rec = read_gate(self.ckpt_dir, phase)
            if rec is None:
                return phase
            if not rec["decision"]["passed"]:
                return None
        return None

    def start_fleet(self) -> None:
        """Place and warm the fleet for the phases left (model built, groups joined)
        while the run's data is still being prepared; ``run`` hands it the data."""
        from stages.trainer.fleet.engine import TrainingEngine

        first = self.first_undecided()
        if first is None or self.engine is not None:
            return
        self.engine = TrainingEngine(
            self.cfg,
            run_id=self.ctx.run_id,
            checkpoint_dir=self.ckpt_dir,
            role_shards=None,
            emit=self.ctx.emit,
            cancel_event=self.ctx.cancel_event,
            wait_decision=self.ctx.wait_decision,
            facts=self.ctx.facts,
            on_phase_end=self._phase_end,
            decided={p.index for p in self.schedule.phases[: first.index]},
            fleet=self.ctx.fleet,  # its ranks go on to the run's next engine run
            secret=self.ctx.secret,
            resize_inbox=self.ctx.resize_inbox,  # the booking's size changes
        )
        self.engine.start_in_background()

    def shutdown(self) -> None:
        """Tear the fleet down (the engine's own run does it too; idempotent)."""
        if self.engine is not None:
            self.engine.shutdown()

    def run(self, data: PhaseData) -> GateOutcome:
        """Decided gates first (a relaunch), then one engine run for the rest."""
        self.data = data
        todo = None
        for phase in self.schedule.phases:
            if self.ctx.cancelled:
                from stages.trainer.fleet.engine import RunCancelled

                raise RunCancelled()
            rec = read_gate(self.ckpt_dir, phase)
            if rec is None:
                # Not decided: train from here. A driver that stopped between a phase's
                # closing checkpoint and its gate resumes the fleet at that boundary,
                # where the gate runs as usual.
                todo = phase
                break
            self.log(
                f"phase {phase.name}: gate already decided in an earlier attempt "
                f"({'passed' if rec['decision']['passed'] else 'failed'})"
            )
            if not self._decided(phase, rec):
                return self._outcome(failed=self._failed)
        if todo is not None:
            self._train(todo)
            if self._failed is not None:
                return self._outcome(failed=self._failed)
        return self._outcome()

    def _decided(self, phase: PhaseSpan, rec: GateRecord) -> bool:
        from stages.evals import BatteryResult, GateDecision

        decision = GateDecision.model_validate(rec["decision"])
        self._previous = BatteryResult.model_validate(rec["result"])
        self.phases.append(self._summary(phase, rec))
        if not decision.passed:
            self._failed = decision
        return decision.passed

    def _closing(self, phase: PhaseSpan) -> CheckpointRecord | None:
        return next((r for r in list_checkpoints(self.ckpt_dir) if r.step == phase.end_step), None)

    # --- training ---------------------------------------------------------------------
    def _train(self, first: PhaseSpan) -> None:
        assert self.data is not None
        latest = list_checkpoints(self.ckpt_dir)
        at = max(latest[-1].step if latest else 0, first.start_step)
        self.log(
            f"training phases {', '.join(p.name for p in self.schedule.phases[first.index :])}"
            f" from step {at} in one fleet"
        )
        for phase in self.schedule.phases[first.index :]:
            self.log(
                f"phase {phase.name} ({phase.kind}): steps {phase.start_step}.."
                f"{phase.end_step}, seq_len {phase.seq_len}, mix {phase.data_weights}, "
                f"peak lr {phase.peak_lr:g} ({phase.lr_schedule}), rope_theta "
                f"{phase.rope_theta}"
            )
        self.start_fleet()  # already placed and warming when the stage was prestarted
        assert self.engine is not None
        self.engine.supply_data(self.data.role_shards)
        result = self.engine.run()
        self.steps = max(self.steps, result.steps)
        self.tokens += result.tokens
        self.interruptions += result.interruptions
        self.final_loss = result.final_loss
        self.proposals += result.proposals
        self.digests = result.digests
        self.rank_digests = result.rank_digests
        self.layout = result.layout
        if self._failed is None and len(self.phases) < len(self.schedule.phases):
            raise ItoError(
                ErrorCode.training_failed,
                f"training stopped at step {result.steps} of {self.schedule.total_steps}",
            )

    def _phase_end(self, phase: PhaseSpan) -> bool:
        """The engine's hook: every live group closed ``phase``; its gate decides."""
        return self._decided(phase, self._evaluate(phase))

    # --- the gate ---------------------------------------------------------------------
    def _evaluate(self, phase: PhaseSpan) -> GateRecord:
        from stages.evals import BatteryResult, GateDecision, evaluate_gates

        closing = self._closing(phase)
        if closing is None:
            raise ItoError(
                ErrorCode.checkpoint_not_found,
                f"phase {phase.name}: no checkpoint at its end step {phase.end_step}",
            )
        if pinned_phase(closing) is None:
            pin_phase(closing, phase.name)
        self.ctx.emit(
            CheckpointEvent(
                stage=STAGE,
                step=closing.step,
                path=closing.path,
                bytes=closing.bytes,
                blocking_s=closing.blocking_s,
                total_s=closing.total_s,
                phase=phase.name,
                closes_phase=True,
            )
        )
        t0 = time.time()
        if phase.eval_battery is None:  # a run without a curriculum: no battery, no gate
            result = BatteryResult(
                battery="",
                phase=phase.name,
                step=closing.step,
                checks=[],
                task_files={},
                started_at=t0,
                seconds=0.0,
            )
            rec: GateRecord = {
                "phase": phase.name,
                "index": phase.index,
                "checkpoint": closing.path,
                "step": closing.step,
                "export": None,
                "eval_seconds": 0.0,
                "result": result.model_dump(mode="json"),
                "decision": GateDecision(
                    battery="", phase=phase.name, passed=True, checks=[], task_files={}
                ).model_dump(mode="json"),
            }
            _write_json(gate_path(self.ckpt_dir, phase), rec)
            return rec
        self.log(
            f"phase {phase.name}: evaluating battery {phase.eval_battery} on step "
            f"{closing.step} on a trainer rank"
        )
        from stages.trainer.phase_eval import PhaseEvalReply, PhaseEvalRequest
        from stages.trainer.rank.phase_data import HELDOUT_NAME

        # The export's metadata carries no verdict: the gate decides after the scores.
        req = PhaseEvalRequest(
            phase=phase,
            checkpoint=closing.path,
            step=closing.step,
            run=run_binding(self.ctx.run_id, self.ctx.facts),
            heldout_path=str(self.ctx.workdir / "phase_data" / HELDOUT_NAME),
            tokenizer_dir=str(self._tokenizer_dir),
            work_dir=str(self.ctx.workdir),
            export_dir=str(self.ckpt_dir / "hf" / phase.name),
            metadata={"run_id": self.ctx.run_id, "phase": phase.name, "step": closing.step},
            settings=self.cfg.evals,
        )
        assert self.engine is not None, "a phase ends inside the engine's run"
        reply = PhaseEvalReply.model_validate(
            self.engine.evaluate_on_rank(
                req.model_dump(mode="json"), self.cfg.evals.rank_eval_timeout_s
            )
        )
        result = BatteryResult.model_validate(reply.result)
        decision = evaluate_gates(result, phase.gates, self._previous)
        export = reply.export
        t1 = time.time()
        self.ctx.emit(PhaseEvent(stage=STAGE, phase="evaluation", start=t0, end=t1))
        for event in decision.events(phase=phase.name, step=closing.step, stage=STAGE):
            self.ctx.emit(event)
        rec = {
            "phase": phase.name,
            "index": phase.index,
            "checkpoint": closing.path,
            "step": closing.step,
            "export": str(export),
            "eval_seconds": t1 - t0,
            "result": result.model_dump(mode="json"),
            "decision": decision.model_dump(mode="json"),
        }
        _write_json(gate_path(self.ckpt_dir, phase), rec)
        self.log(
            decision.summary() + f" ({t1 - t0:.1f}s)", level="info" if decision.passed else "error"
        )
        return rec

    # --- reporting --------------------------------------------------------------------
    def _summary(self, phase: PhaseSpan, rec: GateRecord) -> PhaseSummary:
        return {
            "phase": phase.name,
            "kind": phase.kind,
            "steps": [phase.start_step, phase.end_step],
            "seq_len": phase.seq_len,
            "battery": phase.eval_battery,
            "checkpoint": rec["checkpoint"],
            "export": rec["export"],
            "passed": rec["decision"]["passed"],
            "scores": {c["name"]: c["score"] for c in rec["result"]["checks"]},
            "gates": rec["decision"]["checks"],
        }

    def _outcome(self, failed: GateDecision | None = None) -> GateOutcome:
        metrics: dict[str, float] = {
            "steps": float(self.steps),
            "tokens": float(self.tokens),
            "interruptions": float(self.interruptions),
        }
        if self.final_loss is not None:
            metrics["final_loss"] = self.final_loss
        # The layout the workers built (read back from their mesh), as the gate shows it.
        if (built := self.layout) is not None:
            metrics["layout_pp"] = float(built["pp"])
            metrics["layout_dp_shard"] = float(built["dp_shard"])
            metrics["layout_cp"] = float(built["cp"])
            metrics["layout_tp"] = float(built["tp"])
        for ph in self.phases:
            for check, score in ph["scores"].items():
                if score is not None:
                    metrics[f"eval.{ph['phase']}.{check}"] = float(score)
        artifacts: dict[str, Any] = {
            "checkpoint_dir": str(self.ckpt_dir),
            "phases": self.phases,
            "tokenizer_dir": str(self._tokenizer_dir),
            "proposals": self.proposals,
            "final_checkpoint": self.phases[-1]["checkpoint"] if self.phases else None,
            # The last phase's HF export: what post-training starts from.
            "hf_model_dir": self.phases[-1]["export"] if self.phases else None,
            "replica_digests": {str(g): d for g, d in self.digests.items()},
            "rank_digests": self.rank_digests,
            "layout": self.layout or {},
        }
        if failed is not None:
            artifacts["failed_checks"] = [c.model_dump(mode="json") for c in failed.failing]
            return GateOutcome(
                stage=STAGE,
                status="failed",
                reason=failed.summary(),
                metrics=metrics,
                artifacts=artifacts,
                error_code=ErrorCode.eval_gate_failed.value,
            )
        names = ", ".join(p["phase"] for p in self.phases)
        return GateOutcome(
            stage=STAGE,
            status="passed",
            metrics=metrics,
            artifacts=artifacts,
            reason=f"phases {names}: every gate passed",
        )
