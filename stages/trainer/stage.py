"""``TrainingStage``: the training engine behind the one small Stage protocol."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from stages.base import GateOutcome, StageContext
from stages.errors import ErrorCode, ItoError
from stages.trainer.config import TrainStageConfig

if TYPE_CHECKING:
    from stages.trainer.phases import CurriculumRunner


def resolve_train_files(cfg: TrainStageConfig, ctx: StageContext) -> list[Path]:
    """The config's files, else data prep's ``train_files``, all roles in name order."""
    by_role = resolve_files_by_role(cfg, ctx)
    return [p for role in sorted(by_role) for p in by_role[role]]


def resolve_files_by_role(cfg: TrainStageConfig, ctx: StageContext) -> dict[str, list[Path]]:
    """Train files by data role; the config's own files count as ``baseline``."""
    if cfg.train_files:
        return {"baseline": [Path(p.removeprefix("file://")) for p in cfg.train_files]}
    prep = ctx.previous.get("data_prep")
    files = prep.artifacts.get("train_files") if prep else None
    if not files:
        raise ItoError(
            ErrorCode.data_not_found, "no train_files in the config and no data_prep artifacts"
        )
    if isinstance(files, dict):
        return {role: [Path(p) for p in ps] for role, ps in files.items() if ps}
    return {"baseline": [Path(p) for p in files]}


class TrainingStage:
    name: ClassVar[str] = "train"
    config_model: ClassVar[type[TrainStageConfig]] = TrainStageConfig

    def __init__(self, config: TrainStageConfig, model_roots: Sequence[str] = ()):
        self.config = config
        # The account's data and checkpoint roots, from the supervisor (never the
        # manifest): a named checkpoint or tokenizer folder must lie inside them.
        self.model_roots = tuple(model_roots)
        self._prestarted = False
        self._prestart_error: ItoError | None = None
        self._runner: CurriculumRunner | None = None

    def pin_inputs(self, ctx: StageContext) -> TrainStageConfig:
        """The config with ``model.checkpoint_path`` and ``model.tokenizer_path`` pointing
        at private copies in the run's scratch space, made by the safe walk inside the
        roots (``stages/snapshot.py``): every rank loads what was checked, and a swap
        in the tenant's folder after the check reaches no rank."""
        from stages.pathfields import field_spec, local_path
        from stages.snapshot import snapshot
        from stages.trainer.config import ModelSpec

        model, update = self.config.model, {}
        for name in ("checkpoint_path", "tokenizer_path"):
            raw, spec = getattr(model, name), field_spec(ModelSpec, name)
            if raw is None or spec is None:
                continue
            where = f"model.{name}"
            path = local_path(raw, spec, where)
            assert path is not None
            snap = snapshot(
                path,
                self.model_roots,
                ctx.workdir / "inputs" / name,
                where,
                kind=spec.roots,
                want="dir",
                missing=spec.invalid,
            )
            names = {f.relpath for f in snap.files}
            absent = [n for n in spec.contains if n not in names]
            if absent:
                raise ItoError(spec.invalid, f"{where} has no {', '.join(absent)}")
            update[name] = str(snap.path)
        if not update:
            return self.config
        return self.config.model_copy(update={"model": model.model_copy(update=update)})

    def checkpoint_dir(self, ctx: StageContext) -> Path:
        return Path(self.config.checkpoint.storage_path) / ctx.run_id

    def prestart(self, ctx: StageContext) -> None:
        """Pin the inputs and place the fleet (lighthouse, ranks: imports, model build,
        process groups, torchft Managers) without waiting for it, so it warms up while
        data prep and tokenizing run. ``run`` calls it too (a no-op when the driver
        already did); a failure here is reported by ``run``."""
        if self._prestarted:
            return
        self._prestarted = True
        try:
            from stages.trainer.parallel.layout import check_runnable
            from stages.trainer.phases import CurriculumRunner

            cfg = self.pin_inputs(ctx)
            # What the device cannot run fails here, before any worker starts; each
            # worker checks again against its GPU's compute capability.
            check_runnable(cfg.layout, cfg.device)
            ckpt_dir = self.checkpoint_dir(ctx)
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            self._runner = CurriculumRunner(cfg, ctx, ckpt_dir)
            self._runner.start_fleet()
        except ItoError as e:
            self._prestart_error = e

    def abandon(self) -> None:
        """The run ends before this stage ran (a failed gate upstream, a cancel): tear
        down the fleet ``prestart`` placed."""
        if self._runner is not None:
            self._runner.shutdown()

    def run(self, ctx: StageContext) -> GateOutcome:
        """One path: the pinned inputs and the fleet (placed by ``prestart``), the data
        (held-out split, tokenizer, shards by role), then the schedule's phases in that one
        fleet; a run without a curriculum is a one-phase schedule."""
        from stages.presets import load_model_preset
        from stages.trainer.fleet.engine import RunCancelled
        from stages.trainer.rank.phase_data import prepare_phase_data

        try:
            self.prestart(ctx)
            if self._prestart_error is not None:
                raise self._prestart_error
            assert self._runner is not None
            cfg = self._runner.cfg
            preset = load_model_preset(cfg.model.preset)
            data = prepare_phase_data(
                resolve_files_by_role(cfg, ctx),
                ctx.workdir,
                text_field=cfg.text_field,
                vocab_size=preset.vocab_size,
                permille=cfg.heldout_permille,
                min_docs=cfg.heldout_min_docs,
                tokenizer_path=cfg.model.tokenizer_path,
                model_max_length=preset.max_position_embeddings,
            )
            return self._runner.run(data)
        except RunCancelled:
            return GateOutcome(
                stage=self.name,
                status="failed",
                reason="cancelled",
                error_code=ErrorCode.invalid_state.value,
            )
        except ItoError as e:
            return GateOutcome(
                stage=self.name, status="failed", reason=e.message, error_code=e.code.value
            )
        finally:
            self.abandon()  # a failure before the engine ran must not leave the fleet up
