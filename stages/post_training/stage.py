"""``PostTrainingStage``: the recipe's objectives in order (any prefix of sft -> dpo ->
rlvr), each saved in HF format and followed by its gate; a failed gate stops the run."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from stages.base import GateOutcome, StageContext, StrictModel
from stages.errors import ErrorCode, ItoError
from stages.events import InterruptionEvent, MetricsEvent, PhaseEvent
from stages.pathfields import field_spec, local_path
from stages.placement import actor_options
from stages.post_training.config import PostTrainingConfig, RLVRConfig
from stages.post_training.gate_events import check_gate, objective_gate_events
from stages.trainer.config import TrainStageConfig

if TYPE_CHECKING:
    from stages.evals import BatteryResult, GateDecision
    from stages.post_training.config import ObjectiveBattery
    from stages.post_training.data import Kind
    from stages.post_training.learner import RLVRSide
    from stages.post_training.pools import LocalPool, RayPool
    from stages.trainer.fleet.handoff import Fleet

_spec = field_spec(PostTrainingConfig, "base_model")
assert _spec is not None
BASE_MODEL = _spec
MODEL_INVALID = ErrorCode.post_training_model_invalid
_KINDS: tuple[Kind, ...] = ("sft", "dpo", "rlvr")


class PostTrainingStageConfig(StrictModel):
    recipe: PostTrainingConfig
    output_dir: str = Field(min_length=1)
    # Where rollout workers live: Ray actors (the run's cluster) or in-process threads.
    fleet: Literal["ray", "local"] = "ray"
    device: Literal["cpu", "cuda"] = "cpu"
    # The run's train config: sft and dpo train with its replica groups, device and
    # fault tolerance; None: one replica group on ``device``.
    train: TrainStageConfig | None = None
    ray_namespace: str | None = None
    max_worker_restarts: int = Field(default=3, ge=0)
    # The account's roots, from the supervisor (never the manifest): datasets are read
    # inside the data roots, a named base model inside the data or checkpoint roots.
    data_roots: tuple[str, ...] = ()
    model_roots: tuple[str, ...] = ()


def reward_gain(rewards: list[float]) -> dict[str, float]:
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return {"reward_first": first, "reward_last": last, "reward_gain": last - first}


# What the API validates of each post-training dataset at plan and submit (the run
# validates every row and the whole digest before training): bounded, so a request's
# work is bounded.
VALIDATE_SCAN_BYTES = 16 << 20


def validate_recipe(
    recipe: PostTrainingConfig,
    *,
    data_roots: Sequence[str],
    model_roots: Sequence[str],
    scan_bytes: int = VALIDATE_SCAN_BYTES,
) -> dict[str, int]:
    """The API's validation-time check: the first ``scan_bytes`` of every dataset parse
    in its format (streamed by the safe walk, no row kept) and, when that was the whole
    dataset, match its digest; the reward and batteries are registered and a named base
    model is an HF folder (its digest is checked by the run, which reads the weights).
    Returns the rows seen per objective."""
    from stages.post_training.data import read_dataset
    from stages.post_training.hf_io import check_model_dir
    from stages.snapshot import read_inside

    rows: dict[str, int] = {}
    for objective in _KINDS:
        cfg = getattr(recipe, objective)
        if cfg is not None:
            where = f"post_training.{objective}.data"
            data = read_dataset(
                objective, cfg.data.uri, data_roots, where, max_bytes=scan_bytes, keep_rows=False
            )
            if data.sha256 is not None:
                _check_digest(data.sha256, cfg.data.sha256, where)
            rows[objective] = data.count
    check_recipe(recipe)
    if recipe.base_model is not None:
        where = "post_training.base_model"
        path = local_path(recipe.base_model, BASE_MODEL, where)
        assert path is not None
        names = [
            rel
            for rel, _, _ in read_inside(
                path, model_roots, where, kind="model", want="dir", missing=MODEL_INVALID
            )
        ]
        check_model_dir(names)
    return rows


def check_recipe(recipe: PostTrainingConfig) -> None:
    """Names the recipe picks on the server: eval batteries and the reward."""
    from stages.evals.config import load_battery
    from stages.post_training.rewards import get_reward

    for name in recipe.objectives():
        battery = getattr(recipe, name).eval.battery
        if battery is not None:
            load_battery(battery)  # eval_battery_unknown before anything runs
    if recipe.rlvr is not None:
        get_reward(recipe.rlvr.reward)


def _check_digest(actual: str, expected: str, where: str) -> None:
    if actual != expected:
        raise ItoError(
            ErrorCode.data_digest_mismatch,
            f"{where}: the data's digest does not match its sha256; nothing was trained on it",
        )


class PostTrainingStage:
    name: ClassVar[str] = "post_training"
    config_model: ClassVar[type[PostTrainingStageConfig]] = PostTrainingStageConfig

    def __init__(self, config: PostTrainingStageConfig):
        self.config = config
        self._fleet: Fleet | None = None  # the learner's ranks, handed from objective to objective
        self._rlvr_side: RLVRSide | None = None  # started with the stage, used by RLVR

    # -- inputs ------------------------------------------------------------------------
    def base_model(self, ctx: StageContext) -> Path:
        """The folder the policy loads from: a private copy of the recipe's base model,
        made from the descriptors the safe walk opened and matched against its digest,
        or the pretraining stage's export (the run's own)."""
        from stages.post_training.hf_io import check_model_dir, model_dir
        from stages.snapshot import snapshot

        recipe = self.config.recipe
        if recipe.base_model is not None:
            where = "post_training.base_model"
            path = local_path(recipe.base_model, BASE_MODEL, where)
            assert path is not None
            snap = snapshot(
                path,
                self.config.model_roots,
                ctx.workdir / "inputs" / "base_model",
                where,
                kind="model",
                want="dir",
                missing=MODEL_INVALID,
            )
            if snap.sha256 != recipe.base_model_sha256:
                raise ItoError(
                    ErrorCode.data_digest_mismatch,
                    f"{where}: the folder's digest does not match base_model_sha256"
                    "; nothing was trained on it",
                )
            assert snap.path is not None
            check_model_dir([f.relpath for f in snap.files])
            return snap.path
        train = ctx.previous.get("train")
        arts = train.artifacts if train else {}
        uri = arts.get("hf_model_dir") or arts.get("hf_export_dir") or None
        if uri is None:
            raise ItoError(
                ErrorCode.post_training_model_invalid,
                "no base_model in the recipe and no HF export from pretraining",
            )
        exported = model_dir(str(uri))
        check_model_dir([p.relative_to(exported).as_posix() for p in exported.rglob("*")])
        return exported

    def load_data(self) -> dict[str, list[dict[str, Any]]]:
        """Every dataset's rows, parsed from the bytes its digest was computed over;
        a dataset changed since submit is ``data_digest_mismatch`` before any objective."""
        from stages.post_training.data import read_dataset

        recipe = self.config.recipe
        rows: dict[str, list[dict[str, Any]]] = {}
        for objective in _KINDS:
            cfg = getattr(recipe, objective)
            if cfg is not None:
                where = f"post_training.{objective}.data"
                data = read_dataset(objective, cfg.data.uri, self.config.data_roots, where)
                assert data.sha256 is not None  # read whole
                _check_digest(data.sha256, cfg.data.sha256, where)
                rows[objective] = data.rows
        check_recipe(recipe)
        return rows

    # -- the chain ---------------------------------------------------------------------
    def run(self, ctx: StageContext) -> GateOutcome:
        """The objectives in order, each on the trainer fleet the previous engine run
        left (``stages.trainer.fleet.handoff``): the run's (pretraining's ranks), else the
        stage's own, which it ends."""
        from stages.trainer.fleet.handoff import Fleet

        own = ctx.fleet is None
        self._fleet = Fleet(ctx.workdir / "fleet") if own else ctx.fleet
        try:
            return self._run_chain(ctx)
        finally:
            if self._rlvr_side is not None:  # RLVR never ran (a gate, a cancel, an error)
                self._rlvr_side.close()
                self._rlvr_side = None
            if own:
                self._fleet.shutdown()

    def _run_chain(self, ctx: StageContext) -> GateOutcome:
        from stages.evals import BatteryResult
        from stages.post_training.passed import PassedObjective, load_passed, save_passed
        from stages.trainer.fleet.engine import RunCancelled

        try:
            rows = self.load_data()
            base = self.base_model(ctx)
            out = Path(self.config.output_dir)
            rlvr = self.config.recipe.rlvr
            if rlvr is not None and load_passed(out, "rlvr") is None:
                # The rollout workers and the weight board start (processes, imports,
                # model) while the objectives before RLVR train; at RLVR's start the
                # workers load the policy it starts from as version 0 (BaseWeights), so
                # its first rollouts wait for no process start.
                self._rlvr_side = self._start_rlvr_side(rlvr, ctx, base, rows["rlvr"])
            results: dict[str, Any] = {}
            metrics: dict[str, float] = {}
            current = base
            battery: BatteryResult | None = None
            for objective in self.config.recipe.objectives():
                if ctx.cancelled:
                    return GateOutcome(
                        stage=self.name,
                        status="failed",
                        reason="cancelled",
                        error_code=ErrorCode.invalid_state.value,
                    )
                done = load_passed(out, objective)
                if done is not None:  # an earlier attempt of this run passed it
                    current = Path(done.hf_model_dir)
                    results[objective] = done.model_dump(mode="json", exclude_none=True)
                    metrics.update({f"{objective}_{k}": v for k, v in done.metrics.items()})
                    if done.battery is not None:
                        battery = BatteryResult.model_validate(done.battery)
                    ctx.log(
                        f"post_training {objective}: already passed ({current})", stage=self.name
                    )
                    continue
                t0 = time.time()
                ctx.log(f"post_training {objective}: started from {current.name}", stage=self.name)
                m, current, scored = self._run_objective(
                    objective, ctx, rows[objective], out, current
                )
                m["seconds"] = time.time() - t0
                ctx.emit(MetricsEvent(stage=self.name, step=0, scope=objective, values=m))
                results[objective] = {"metrics": m, "hf_model_dir": str(current)}
                metrics.update({f"{objective}_{k}": v for k, v in m.items()})
                objective_cfg = getattr(self.config.recipe, objective)
                failed = check_gate(objective, objective_cfg.gate, m)
                decision = None
                if failed is None and objective_cfg.eval.battery is not None:
                    assert scored is not None  # every objective scores its battery when named
                    failed, battery, decision = self._battery(
                        objective, objective_cfg.eval, scored, battery, ctx
                    )
                    results[objective]["battery"] = battery.model_dump(mode="json")
                for event in objective_gate_events(
                    objective,
                    objective_cfg.gate,
                    m,
                    steps=getattr(objective_cfg, "steps", None),
                    battery=decision,
                ):
                    ctx.emit(event.model_copy(update={"stage": self.name}))
                ctx.log(
                    f"post_training {objective}: gate {'failed: ' + failed if failed else 'passed'}"
                    f"; saved {current}",
                    stage=self.name,
                )
                if failed:
                    return GateOutcome(
                        stage=self.name,
                        status="failed",
                        reason=failed,
                        metrics=metrics,
                        # Per objective, under a kept wire name (docs/architecture.md).
                        artifacts={"steps": results},
                        error_code=ErrorCode.eval_gate_failed.value,
                    )
                save_passed(out, objective, PassedObjective.model_validate(results[objective]))
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
        return GateOutcome(
            stage=self.name,
            status="passed",
            reason=f"post-training {' -> '.join(results) or 'empty'} passed every gate",
            metrics=metrics,
            artifacts={"steps": results, "hf_model_dir": str(current)},
        )

    def _battery(
        self,
        objective: str,
        spec: ObjectiveBattery,
        result: BatteryResult,
        previous: BatteryResult | None,
        ctx: StageContext,
    ) -> tuple[str | None, BatteryResult, GateDecision]:
        """The curriculum's gates on an objective's battery ``result``; (reason or None,
        result, the ``GateDecision``)."""
        from stages.evals import evaluate_gates

        decision = evaluate_gates(result, list(spec.gates), previous)
        ctx.emit(
            PhaseEvent(
                stage=self.name,
                phase="evaluation",
                start=result.started_at,
                end=result.started_at + result.seconds,
            )
        )
        scores = {c.name: c.score for c in result.checks if c.score is not None}
        ctx.emit(MetricsEvent(stage=self.name, step=0, scope=f"{objective}.battery", values=scores))
        return (None if decision.passed else decision.summary()), result, decision

    def _run_objective(
        self,
        objective: str,
        ctx: StageContext,
        rows: list[dict[str, Any]],
        out: Path,
        current: Path,
    ) -> tuple[dict[str, float], Path, BatteryResult | None]:
        """Train ``objective`` from the HF folder ``current``: (gate metrics, its HF
        export under ``out/<objective>``, its battery's ``BatteryResult`` or None). SFT and
        DPO are trained and scored on the engine's ranks: no model in this process."""

        recipe = self.config.recipe
        if objective in ("sft", "dpo"):
            from stages.evals import BatteryResult
            from stages.evals.objective_battery import objective_gate_metrics
            from stages.post_training.on_engine import run_on_engine

            kind: Literal["sft", "dpo"] = "sft" if objective == "sft" else "dpo"
            exported, figures, scores = run_on_engine(
                kind,
                getattr(recipe, kind),
                ctx,
                stage=self.name,
                base=current,
                rows=rows,
                export_dir=out / objective,
                train=self.config.train,
                device=self.config.device,
                fleet=self._fleet,
            )
            battery = BatteryResult.model_validate(scores.battery) if scores.battery else None
            m = {**objective_gate_metrics(kind, scores.before, scores.after), **figures}
            return m, exported, battery
        assert recipe.rlvr is not None
        # The learner's ranks and the rollout workers start from the previous
        # objective's export (or the base), and its battery runs on the evaluating rank:
        # no model in this process.
        return self._run_rlvr(recipe.rlvr, ctx, rows, current, out / objective)

    def _start_rlvr_side(
        self, cfg: RLVRConfig, ctx: StageContext, model_dir: Path, rows: list[dict[str, Any]]
    ) -> RLVRSide:
        from stages.post_training.learner import RLVRSide
        from stages.post_training.weight_board import board_name, start_board
        from stages.post_training.weight_sync import sync_key

        pool = self._rollout_pool(cfg, ctx, model_dir)
        name = board_name(ctx.run_id, uuid.uuid4().hex[:8])
        # Worker 0 encodes the prompts as soon as it is up (it holds the run's
        # tokenizer; this process loads none).
        return RLVRSide(
            pool=pool,
            prompts=pool.encode_prompts(rows),
            board=(
                name,
                start_board(
                    name, 1, placement=actor_options(ctx.facts), sync_key=sync_key(ctx.secret)
                ),
            ),
        )

    def _rollout_pool(
        self, cfg: RLVRConfig, ctx: StageContext, model_dir: Path
    ) -> LocalPool | RayPool:
        """RLVR's rollout workers, built on ``model_dir`` (they refuse rollouts until
        the learner's version 0 tells them which policy to load)."""
        from stages.post_training.pools import LocalPool, RayPool
        from stages.post_training.rollout import RolloutWorker, WorkerSpec
        from stages.post_training.weight_sync import sync_key

        local = self.config.fleet == "local"
        # In-process workers run in the driver's process, which holds no GPU.
        device = "cpu" if local else self.config.device
        specs = [
            WorkerSpec.for_recipe(cfg, n, str(model_dir), device)
            for n in range(cfg.rollout_workers)
        ]
        key = sync_key(ctx.secret)  # to the workers as an actor argument, nowhere else
        sync: dict[str, Any] = {
            "weight_sync": cfg.weight_sync,
            "bucket_bytes": cfg.weight_sync_bucket_mb << 20,
            "sync_timeout_s": cfg.weight_sync_timeout_s,
            "sync_key": key,
        }
        if local:
            return LocalPool([RolloutWorker(s, key) for s in specs], **sync)
        import ray

        if not ray.is_initialized():
            raise ItoError(ErrorCode.ray_unavailable, "Ray is not initialised here")
        return RayPool(
            ctx.run_id,
            specs,
            device=self.config.device,
            max_restarts=self.config.max_worker_restarts,
            namespace=self.config.ray_namespace,
            placement=actor_options(ctx.facts),
            **sync,
        )

    def _run_rlvr(
        self,
        cfg: RLVRConfig,
        ctx: StageContext,
        rows: list[dict[str, Any]],
        init: Path,
        export_dir: Path,
    ) -> tuple[dict[str, float], Path, BatteryResult | None]:
        """The rollout fleet on the driver's side, the learner on the engine's replica
        groups (``stages.post_training.learner``): (gate metrics, the HF export, its
        battery's ``BatteryResult`` or None, scored on the evaluating rank)."""
        from stages.evals import BatteryResult
        from stages.evals.objective_eval import ObjectiveEvalRequest
        from stages.post_training.learner import run_rlvr_on_engine
        from stages.post_training.on_engine import write_rows
        from stages.post_training.rl import RequestMaker

        side = self._rlvr_side or self._start_rlvr_side(cfg, ctx, init, rows)
        self._rlvr_side = None  # closed below, whatever happens

        def interrupted(w: int, lost: float, back: float, detail: str) -> None:
            ctx.emit(
                InterruptionEvent(
                    stage=self.name,
                    interruption_kind="rollout_worker_lost",
                    detected_at=lost,
                    recovered_at=back,
                    detail=f"rollout-{w}: {detail}",
                )
            )

        scoring = None
        if cfg.eval.battery is not None:
            scoring = ObjectiveEvalRequest(
                kind="rlvr",
                rows_path=str(write_rows(rows, ctx.workdir / "rlvr" / "data.jsonl")),
                base_dir=str(init),
                battery=cfg.eval.battery,
                phase=f"{self.name}.rlvr",
            )
        try:
            prompts = side.prompts(cfg.worker_ready_timeout_s)
            side.pool.wait_started(cfg.worker_ready_timeout_s)
            result, exported, _, scores = run_rlvr_on_engine(
                cfg,
                ctx,
                stage=self.name,
                base=init,
                export_dir=export_dir,
                train=self.config.train,
                device=self.config.device,
                pool=side.pool,
                maker=RequestMaker(cfg, prompts, rows),
                pad_id=prompts.pad_id,
                on_interruption=interrupted,
                scoring=scoring,
                fleet=self._fleet,
                board=side.board,
            )
        finally:
            side.close()
        m = {**result.summary, **reward_gain(result.rewards), "steps": float(result.steps)}
        battery = (
            BatteryResult.model_validate(scores.battery) if scores and scores.battery else None
        )
        return m, exported, battery
