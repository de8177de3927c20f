"""Curriculum phases, executed: train a phase, close it with a kept checkpoint, run
its eval battery, export it in HF format, and let its gate decide.

Each phase is one engine run over that phase's steps only (its own sequence length,
data mix, LR schedule and RoPE base), resumed from the checkpoint that closed the
previous phase; no step of one phase can train on another's data or length. A
phase's gate result is written beside its checkpoints before the next phase starts,
so a relaunched driver skips passed phases, resumes the unfinished one at its step,
and never re-scores a decided gate: a failed gate stays failed. Nothing overrides it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from stages.base import GateOutcome, StageContext
from stages.checkpointing.storage import list_checkpoints, pin_phase, pinned_phase
from stages.curriculum.plan import PhasePlan
from stages.errors import ErrorCode, ItoError
from stages.events import CheckpointEvent, EvalEvent, LogEvent, PhaseEvent
from stages.trainer.config import TrainStageConfig
from stages.trainer.phase_data import PhaseData

STAGE = "train"
# Seconds to wait for the previous phase's actor names to be released by Ray.
ACTOR_NAMES_FREE_TIMEOUT_S = 30.0


def gate_path(ckpt_dir: Path, phase: PhasePlan) -> Path:
    return ckpt_dir / "phases" / f"{phase.index:02d}-{phase.name}.json"


def read_gate(ckpt_dir: Path, phase: PhasePlan) -> dict[str, Any] | None:
    p = gate_path(ckpt_dir, phase)
    return json.loads(p.read_text()) if p.is_file() else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _wait_actor_names_free(run_id: str) -> None:
    import ray

    from stages.trainer.replica import lighthouse_name, trainer_prefix

    deadline = time.time() + ACTOR_NAMES_FREE_TIMEOUT_S
    while time.time() < deadline:
        names = [n for n in ray.util.list_named_actors() if isinstance(n, str)
                 and (n.startswith(trainer_prefix(run_id)) or n == lighthouse_name(run_id))]
        if not names:
            return
        time.sleep(0.2)


def load_phase_model(cfg: TrainStageConfig, phase: PhasePlan, checkpoint: str) -> Any:
    """The weights of a complete checkpoint in a fresh model of the phase's shape."""
    from stages.checkpointing.checkpointer import load_sealed
    from stages.checkpointing.seal import seal_key
    from stages.presets import load_model_preset
    from stages.trainer.model import build_model, set_rope_theta

    model = build_model(load_model_preset(cfg.model.preset), seed=cfg.target.seed,
                        checkpoint_path=cfg.model.checkpoint_path)
    if phase.rope_theta is not None:
        set_rope_theta(model, phase.rope_theta)
    sd = model.state_dict()
    load_sealed({"train": {"model": sd}}, Path(checkpoint), seal_key())
    model.load_state_dict(sd)
    model.eval()
    return model


class CurriculumRunner:
    def __init__(self, cfg: TrainStageConfig, ctx: StageContext, ckpt_dir: Path,
                 data: PhaseData):
        assert cfg.curriculum is not None
        self.cfg = cfg
        self.plan = cfg.curriculum
        self.ctx = ctx
        self.ckpt_dir = ckpt_dir
        self.data = data
        self.steps = 0
        self.tokens = 0
        self.interruptions = 0
        self.final_loss: float | None = None
        self.proposals: list[str] = []
        self.digests: dict[int, str] = {}
        self.rank_digests: Any = {}
        self.layout: dict[str, Any] = {}
        self.phases: list[dict[str, Any]] = []

    def log(self, message: str, level: Any = "info") -> None:
        self.ctx.emit(LogEvent(stage=STAGE, level=level, message=message))

    def run(self) -> GateOutcome:
        previous = None
        for phase in self.plan.phases:
            from stages.evals import BatteryResult, GateDecision

            if self.ctx.cancelled:
                from stages.trainer.engine import RunCancelled

                raise RunCancelled()
            rec = read_gate(self.ckpt_dir, phase)
            if rec is None:
                self._train(phase)
                rec = self._evaluate(phase, previous)
            else:
                self.log(f"phase {phase.name}: gate already decided in an earlier attempt "
                         f"({'passed' if rec['decision']['passed'] else 'failed'})")
            decision = GateDecision.model_validate(rec["decision"])
            previous = BatteryResult.model_validate(rec["result"])
            self.phases.append(self._summary(phase, rec))
            if not decision.passed:
                return self._outcome(failed=decision)
        return self._outcome()

    # --- training ---------------------------------------------------------------------
    def _train(self, phase: PhasePlan) -> None:
        from stages.trainer.engine import TrainingEngine

        latest = list_checkpoints(self.ckpt_dir)
        at = latest[-1].step if latest else 0
        if at >= phase.end_step:
            self.log(f"phase {phase.name}: already trained to step {at}")
            return
        self.log(f"phase {phase.name} ({phase.kind}): steps {max(at, phase.start_step)}.."
                 f"{phase.end_step}, seq_len {phase.seq_len}, mix {phase.data_weights}, "
                 f"peak lr {phase.peak_lr:g} ({phase.lr_schedule}), rope_theta "
                 f"{phase.rope_theta}")
        cfg = self.cfg.model_copy(update={
            "phase_index": phase.index,
            "target": self.cfg.target.model_copy(update={"seq_len": phase.seq_len})})
        _wait_actor_names_free(self.ctx.run_id)
        engine = TrainingEngine(cfg, run_id=self.ctx.run_id, checkpoint_dir=self.ckpt_dir,
                                shards=[], emit=self.ctx.emit,
                                cancel_event=self.ctx.cancel_event,
                                wait_decision=self.ctx.wait_decision,
                                facts=self.ctx.facts, role_shards=self.data.role_shards)
        result = engine.run()
        self.steps = max(self.steps, result.steps)
        self.tokens += result.tokens
        self.interruptions += result.interruptions
        self.final_loss = result.final_loss if result.final_loss is not None else \
            self.final_loss
        self.proposals += result.proposals
        self.digests = result.digests
        self.rank_digests = result.rank_digests
        self.layout = result.layout or self.layout
        if result.steps < phase.end_step:
            raise ItoError(ErrorCode.training_failed,
                           f"phase {phase.name} stopped at step {result.steps} of "
                           f"{phase.end_step}")

    # --- the gate ---------------------------------------------------------------------
    def _evaluate(self, phase: PhasePlan, previous: Any) -> dict[str, Any]:
        from stages.evals import evaluate_gates, run_battery
        from stages.hf import export_hf

        records = [r for r in list_checkpoints(self.ckpt_dir) if r.step == phase.end_step]
        if not records:
            raise ItoError(ErrorCode.checkpoint_not_found,
                           f"phase {phase.name}: no checkpoint at its end step "
                           f"{phase.end_step}")
        closing = records[0]
        if pinned_phase(closing) is None:
            pin_phase(closing, phase.name)
        self.ctx.emit(CheckpointEvent(stage=STAGE, step=closing.step, path=closing.path,
                                      bytes=closing.bytes, blocking_s=closing.blocking_s,
                                      total_s=closing.total_s, phase=phase.name,
                                      closes_phase=True))
        t0 = time.time()
        self.log(f"phase {phase.name}: evaluating battery {phase.eval_battery} on step "
                 f"{closing.step}")
        model = load_phase_model(self.cfg, phase, closing.path)
        result = run_battery(model, self.data.tokenizer, phase.eval_battery,
                             self.data.heldout_texts, seq_len=phase.seq_len, phase=phase.name,
                             step=closing.step, settings=self.cfg.evals,
                             work_dir=self.ctx.workdir)
        decision = evaluate_gates(result, phase.gates, previous)
        export = export_hf(model, self.data.tokenizer, self.ckpt_dir / "hf" / phase.name,
                           metadata={"run_id": self.ctx.run_id, "phase": phase.name,
                                     "step": closing.step, "gate_passed": decision.passed})
        t1 = time.time()
        self.ctx.emit(PhaseEvent(stage=STAGE, phase="evaluation", start=t0, end=t1))
        for v in decision.checks:
            self.ctx.emit(EvalEvent(stage=STAGE, phase=phase.name, battery=result.battery,
                                    check=v.check, score=v.score, passed=v.passed,
                                    reason=v.reason, min=v.min, max=v.max,
                                    max_regression=v.max_regression, previous=v.previous,
                                    step=closing.step))
        rec = {"phase": phase.name, "index": phase.index, "checkpoint": closing.path,
               "step": closing.step, "export": str(export), "eval_seconds": t1 - t0,
               "result": result.model_dump(mode="json"),
               "decision": decision.model_dump(mode="json")}
        _write_json(gate_path(self.ckpt_dir, phase), rec)
        self.log(decision.summary() + f" ({t1 - t0:.1f}s)",
                 level="info" if decision.passed else "error")
        return rec

    # --- reporting --------------------------------------------------------------------
    def _summary(self, phase: PhasePlan, rec: dict[str, Any]) -> dict[str, Any]:
        return {"phase": phase.name, "kind": phase.kind, "steps": [phase.start_step,
                                                                   phase.end_step],
                "seq_len": phase.seq_len, "battery": phase.eval_battery,
                "checkpoint": rec["checkpoint"], "export": rec["export"],
                "passed": rec["decision"]["passed"],
                "scores": {c["name"]: c["score"] for c in rec["result"]["checks"]},
                "gates": rec["decision"]["checks"]}

    def _outcome(self, failed: Any = None) -> GateOutcome:
        metrics: dict[str, float] = {"steps": float(self.steps), "tokens": float(self.tokens),
                                     "interruptions": float(self.interruptions)}
        if self.final_loss is not None:
            metrics["final_loss"] = self.final_loss
        # The layout the workers built (read back from their mesh), as the gate shows it.
        for dim in ("pp", "dp_shard", "cp", "tp"):
            if dim in self.layout:
                metrics[f"layout_{dim}"] = float(self.layout[dim])
        for ph in self.phases:
            for check, score in ph["scores"].items():
                if score is not None:
                    metrics[f"eval.{ph['phase']}.{check}"] = float(score)
        artifacts: dict[str, Any] = {
            "checkpoint_dir": str(self.ckpt_dir), "phases": self.phases,
            "tokenizer_dir": str(self.data.tokenizer_dir), "proposals": self.proposals,
            "final_checkpoint": self.phases[-1]["checkpoint"] if self.phases else None,
            # The last phase's HF export: what post-training starts from.
            "hf_model_dir": self.phases[-1]["export"] if self.phases else None,
            "replica_digests": {str(g): d for g, d in self.digests.items()},
            "rank_digests": self.rank_digests, "layout": self.layout}
        if failed is not None:
            artifacts["failed_checks"] = [c.model_dump(mode="json") for c in failed.failing]
            return GateOutcome(stage=STAGE, status="failed", reason=failed.summary(),
                               metrics=metrics, artifacts=artifacts,
                               error_code=ErrorCode.eval_gate_failed.value)
        names = ", ".join(p["phase"] for p in self.phases)
        return GateOutcome(stage=STAGE, status="passed", metrics=metrics, artifacts=artifacts,
                           reason=f"phases {names}: every gate passed")
