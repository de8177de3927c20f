"""An SFT or DPO objective of the post-training chain on the training engine:
replica-group actors (``TrainingEngine`` -> ``ReplicaWorker``) load the policy from the
objective's HF folder, train its loss (``stages.post_training.objectives``) with torchft
and DCP checkpoints, and rank 0 of the lowest live group writes the HF export of the
final weights at the objective's end and scores the objective's gate metrics and
battery there (``stages.trainer.phase_eval``, ``stages.evals.objective_eval``).
The driver only builds the config, forwards events and gets a path and numbers back.
The rlvr objective runs the same engine with the ``grpo`` loss
(``stages.post_training.learner``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Literal

from stages.base import StageContext
from stages.checkpointing.config import CheckpointPolicy
from stages.curriculum.schedule import CurriculumSchedule, PhaseSpan
from stages.errors import ErrorCode, ItoError
from stages.evals.objective_eval import ObjectiveEvalReply, ObjectiveEvalRequest
from stages.events import Event
from stages.post_training.config import OBJECTIVE_BUILDER, DPOConfig, SFTConfig
from stages.trainer.config import (
    LossSpikeConfig,
    ModelSpec,
    ObjectiveConfig,
    TrainingTarget,
    TrainStageConfig,
)
from stages.trainer.fleet.handoff import Fleet

# A label only: a run with ``checkpoint_path`` builds the architecture from the folder.
_PRESET = "llama-tiny"


def objective_train_config(
    kind: Literal["sft", "dpo"],
    cfg: SFTConfig | DPOConfig,
    *,
    base: Path,
    data_path: Path,
    checkpoint_dir: Path,
    train: TrainStageConfig | None,
    device: Literal["cpu", "cuda"],
) -> TrainStageConfig:
    """The engine config of an sft or dpo objective (``engine_config``): the recipe's
    steps, LR, AdamW betas, batch, length and beta; checkpoints every
    ``checkpoint_every_steps`` (else only the objective's closing one)."""
    return engine_config(
        ObjectiveConfig.model_validate(
            {
                "kind": kind,
                "builder": OBJECTIVE_BUILDER,
                "data_path": str(data_path),
                "batch_size": cfg.batch_size,
                "max_length": cfg.max_length,
                **({"beta": cfg.beta} if isinstance(cfg, DPOConfig) else {}),
            }
        ),
        steps=cfg.steps,
        learning_rate=cfg.learning_rate,
        adam_betas=cfg.adam_betas,
        checkpoint_every=cfg.checkpoint_every_steps or cfg.steps,
        base=base,
        checkpoint_dir=checkpoint_dir,
        train=train,
        device=device,
    )


def engine_config(
    objective: ObjectiveConfig,
    *,
    steps: int,
    learning_rate: float,
    adam_betas: tuple[float, float],
    checkpoint_every: int,
    base: Path,
    checkpoint_dir: Path,
    train: TrainStageConfig | None,
    device: Literal["cpu", "cuda"],
    name: str | None = None,
) -> TrainStageConfig:
    """The engine config of one post-training objective: one phase (named ``name``,
    default the objective's kind) of ``steps`` optimizer steps of ``objective``;
    replica groups, their ranks (``ParallelLayout.for_post_training``), device and
    fault tolerance from the run's train config when the stage has one, else one
    group on ``device``. A constant LR without warmup, as the recipe's objectives
    always trained; no loss-spike pause (an objective is too short for the detector's
    window, and nobody is asked mid-chain)."""
    kind = name or objective.kind
    batch_size, max_length = objective.batch_size, objective.max_length
    schedule = CurriculumSchedule(
        total_steps=steps,
        global_batch_tokens=batch_size * max_length,
        phases=[
            PhaseSpan(
                index=0,
                name=kind,
                kind=kind,
                start_step=0,
                end_step=steps,
                seq_len=max_length,
                token_budget=steps * batch_size * max_length,
                data_weights={},
                eval_battery=None,
                lr_schedule="constant",
                peak_lr=learning_rate,
                warmup_steps=0,
                decay_steps=0,
                min_lr_ratio=1.0,
            )
        ],
    )
    run: dict[str, Any] = {"replica_groups": 1, "device": device}
    if train is not None:
        run = {
            "replica_groups": train.replica_groups,
            "ranks_per_group": train.ranks_per_group,
            "parallel": train.layout.for_post_training(),
            "device": train.device,
            "fault_tolerance": train.fault_tolerance,
            "worker_num_cpus": train.worker_num_cpus,
            "pin_group_cores": train.pin_group_cores,
            # The operator's pacing knobs hold for every step of the run (0 in real runs).
            "pace_step_s": train.pace_step_s,
            "degraded_pace_step_s": train.degraded_pace_step_s,
        }
    try:
        return TrainStageConfig(
            model=ModelSpec(preset=_PRESET, size="base", checkpoint_path=str(base)),
            target=TrainingTarget(
                max_steps=steps,
                seq_len=max_length,
                global_batch_tokens=batch_size * max_length,
                learning_rate=learning_rate,
                warmup_steps=0,
                weight_decay=0.0,
                adam_betas=adam_betas,
            ),
            # The engine also forces one at the phase's end (the objective's closing one);
            # two kept: the newest may be mid-write at a kill.
            checkpoint=CheckpointPolicy(
                interval_steps=checkpoint_every,
                keep=2,
                storage_uri=f"file://{checkpoint_dir.resolve()}",
            ),
            loss_spike=LossSpikeConfig(enabled=False),
            spare_groups=0,
            curriculum=schedule,
            objective=objective,
            **run,
        )
    except ValueError as e:  # pydantic's ValidationError: e.g. a batch the groups cannot split
        raise ItoError(ErrorCode.manifest_invalid, f"post_training.{kind}: {e}") from e


def write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    """The objective's rows, parsed from the digest-checked bytes, as the private JSONL
    every rank reads (never the tenant's file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def run_on_engine(
    kind: Literal["sft", "dpo"],
    cfg: SFTConfig | DPOConfig,
    ctx: StageContext,
    *,
    stage: str,
    base: Path,
    rows: list[dict[str, Any]],
    export_dir: Path,
    train: TrainStageConfig | None,
    device: Literal["cpu", "cuda"],
    fleet: Fleet | None = None,
) -> tuple[Path, dict[str, float], ObjectiveEvalReply]:
    """Train the objective on the engine (on ``fleet``'s ranks when it holds some);
    returns the HF export of its final weights, the engine's figures and the
    objective's scores from the evaluating rank. Checkpoints go under
    ``ctx.workdir/<objective>/checkpoints``."""
    work = ctx.workdir / kind
    ckpt_dir = work / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    data_path = write_rows(rows, work / "data.jsonl")
    tcfg = objective_train_config(
        kind,
        cfg,
        base=base,
        data_path=data_path,
        checkpoint_dir=ckpt_dir,
        train=train,
        device=device,
    )
    scoring = ObjectiveEvalRequest(
        kind=kind,
        rows_path=str(data_path),
        base_dir=str(base),
        battery=cfg.eval.battery,
        phase=f"{stage}.{kind}",
    )
    exported, figures, scores = run_engine(
        tcfg,
        ctx,
        stage=stage,
        base=base,
        work=work,
        export_dir=export_dir,
        scoring=scoring,
        fleet=fleet,
    )
    assert scores is not None  # asked for in the request
    return exported, figures, scores


def run_engine(
    tcfg: TrainStageConfig,
    ctx: StageContext,
    *,
    stage: str,
    base: Path,
    work: Path,
    export_dir: Path,
    cancel_event: threading.Event | None = None,
    scoring: ObjectiveEvalRequest | None = None,
    fleet: Fleet | None = None,
) -> tuple[Path, dict[str, float], ObjectiveEvalReply | None]:
    """Run one post-training objective's engine (checkpoints under
    ``work/checkpoints``) to its end and export the final weights from a rank, which
    also scores ``scoring`` there; ``cancel_event`` (default: the run's) stops it.
    With a ``fleet`` the engine starts on the ranks the previous objective left there
    and leaves its own. Returns the export, the engine's figures and the scores."""
    import ray

    from stages.checkpointing.seal import run_binding
    from stages.checkpointing.storage import list_checkpoints
    from stages.trainer.fleet.engine import TrainingEngine
    from stages.trainer.phase_eval import PhaseEvalReply, PhaseEvalRequest

    kind = tcfg.schedule.phases[0].name  # the objective's name
    steps = tcfg.schedule.total_steps
    if not ray.is_initialized():
        raise ItoError(
            ErrorCode.ray_unavailable, f"post_training.{kind}: Ray is not initialised here"
        )
    ckpt_dir = work / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    exported: list[PhaseEvalReply] = []
    engine: TrainingEngine

    def emit(event: Event) -> None:
        # Every event of this engine is the objective's (the engine labels its own
        # "train"): steps carry this stage and the objective's name as their phase, so
        # goodput counts them as productive time of their own, apart from pretraining's
        # steps.
        event.stage = stage
        ctx.emit(event)

    engine_run_id = f"{ctx.run_id}-{kind}"

    def export(phase: PhaseSpan) -> bool:
        closing = next((r for r in list_checkpoints(ckpt_dir) if r.step == phase.end_step), None)
        if closing is None:
            raise ItoError(
                ErrorCode.checkpoint_not_found,
                f"post_training.{kind}: no checkpoint at its end step {phase.end_step}",
            )
        req = PhaseEvalRequest(
            phase=phase,
            checkpoint=closing.path,
            step=closing.step,
            # The engine's run (its checkpoints are sealed for it), not the stage's.
            run=run_binding(engine_run_id, ctx.facts),
            heldout_path="",
            tokenizer_dir=str(base),
            work_dir=str(work),
            export_dir=str(export_dir),
            # "step" names the objective here: a kept wire name (docs/architecture.md).
            metadata={"run_id": ctx.run_id, "step": kind},
            settings=tcfg.evals,
            post_training=scoring,
        )
        reply = PhaseEvalReply.model_validate(
            engine.evaluate_on_rank(req.model_dump(mode="json"), tcfg.evals.rank_eval_timeout_s)
        )
        exported.append(reply)
        return True

    engine = TrainingEngine(
        tcfg,
        run_id=engine_run_id,
        checkpoint_dir=ckpt_dir,
        role_shards={},
        emit=emit,
        cancel_event=cancel_event or ctx.cancel_event,
        wait_decision=ctx.wait_decision,
        facts=ctx.facts,
        on_phase_end=export,
        fleet=fleet,
        secret=ctx.secret,
    )
    result = engine.run()
    if not exported or result.steps < steps:
        raise ItoError(
            ErrorCode.training_failed,
            f"post_training.{kind}: the engine stopped at step {result.steps} of {steps}",
        )
    figures = {"steps": float(result.steps), "interruptions": float(result.interruptions)}
    if result.final_loss is not None:
        figures["final_loss"] = float(result.final_loss)
    return Path(exported[-1].export), figures, exported[-1].post_training
