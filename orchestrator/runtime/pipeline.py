"""The run's pipeline, built from its manifest: plan → data prep → train → post-training.

Each entry is a stage name and a factory that builds the stage from the run
context, so a later stage can use what an earlier one decided (the training stage
takes its replica-group layout from the planner's outcome). Stages never import
the orchestrator; this is the one place that maps manifest sections to stage
configs.
"""

from __future__ import annotations

from typing import Any

from orchestrator.gates.manifest import Manifest
from orchestrator.gates.planning import parallelism_config
from orchestrator.runtime.factories import StageFactory, StartEarly
from orchestrator.runtime.launch import LaunchSpec
from stages.base import Stage, StageContext


def _data_prep(manifest: Manifest, spec: LaunchSpec) -> StageFactory:
    def make(ctx: StageContext) -> Stage:
        from stages.data_prep import DataPrepStage

        # The account's data roots, set by the supervisor from the store (never from the
        # manifest): the stage resolves every reference inside them again at run time.
        return DataPrepStage(manifest.data, data_roots=spec.facts.data_roots)

    return make


def _parallelism(manifest: Manifest, spec: LaunchSpec) -> StageFactory:
    def make(ctx: StageContext) -> Stage:
        from stages.parallelism import ParallelismStage

        return ParallelismStage(parallelism_config(manifest, spec.facts.booking.as_dict()))

    return make


def _train(manifest: Manifest, spec: LaunchSpec) -> StageFactory:
    def make(ctx: StageContext) -> Stage:
        from orchestrator.gates.curriculum import curriculum_schedule
        from stages.replica_sync import ReplicaSync
        from stages.trainer.config import TrainStageConfig
        from stages.trainer.fleet.recovery import production_recovery
        from stages.trainer.parallel.layout import layout_from_plan
        from stages.trainer.stage import TrainingStage

        plan = ctx.previous["parallelism"].artifacts["plan"]
        ranks = int(plan["dp_shard"]) * int(plan["tp"]) * int(plan["pp"]) * int(plan["cp"])
        recovery = production_recovery(spec.facts.booking.as_dict())
        # The manifest's typed parts go in as they are (parsed once, by build_pipeline);
        # only the plan's numbers and the operator's overrides are validated here.
        fields: dict[str, Any] = {
            "model": manifest.model,
            "target": manifest.training,
            "checkpoint": manifest.checkpoint,
            "loss_spike": manifest.loss_spike,
            "replica_groups": int(plan["dp_replicate"]),
            "ranks_per_group": ranks,
            # The plan's layout inside each group: the trainer builds exactly this.
            "parallel": layout_from_plan(plan),
            # How its groups sync: the plan's ``Plan.sync`` (the planner's choice from
            # the fabric, or the manifest's pin); a plan stored without one synced
            # every step.
            "sync": ReplicaSync.model_validate(plan.get("sync") or {}),
            "device": spec.facts.device,
            # Warm standbys and FT timeouts: the configuration the benchmark measures.
            **recovery.train_fields(),
            "curriculum": curriculum_schedule(manifest),
        }
        # Operator-level knobs (never from the tenant's manifest): test pacing, FT timeouts.
        fields.update(spec.facts.train_overrides)
        return TrainingStage(TrainStageConfig(**fields), model_roots=spec.facts.model_roots)

    return make


def _post_training(manifest: Manifest, spec: LaunchSpec) -> StageFactory:
    def make(ctx: StageContext) -> Stage:
        from stages.post_training import PostTrainingStage, PostTrainingStageConfig

        out = f"{manifest.checkpoint.storage_path.rstrip('/')}/{ctx.run_id}/post_training"
        # sft and dpo train on the engine with the run's replica groups, device and
        # fault tolerance: the train stage's config, as pretraining ran it.
        train = _train(manifest, spec)(ctx) if "parallelism" in ctx.previous else None
        return PostTrainingStage(
            PostTrainingStageConfig(
                recipe=manifest.post_training,
                output_dir=out,
                device=spec.facts.device,
                fleet="ray",
                train=getattr(train, "config", None),
                data_roots=spec.facts.data_roots,
                model_roots=spec.facts.model_roots,
            )
        )

    return make


def build_pipeline(spec: LaunchSpec) -> list[tuple[str, StageFactory]]:
    manifest = Manifest.model_validate_json(spec.manifest_json)
    # The plan needs only the manifest and the booking, so it comes first: the trainer
    # fleet it lays out is then placed and warmed up (imports, model build, process
    # groups) while data prep runs, and torn down if data prep's gate fails.
    stages: list[tuple[str, StageFactory]] = [
        ("parallelism", _parallelism(manifest, spec)),
        ("data_prep", _data_prep(manifest, spec)),
        ("train", StartEarly(_train(manifest, spec), after="parallelism")),
    ]
    if manifest.post_training.objectives():
        stages.append(("post_training", _post_training(manifest, spec)))
    return stages
