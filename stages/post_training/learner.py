"""The RLVR objective on the training engine: the driver coordinates, the ranks learn.

The driver runs the rollout controller (``rl.run_rlvr`` with an ``EngineLearner``) on
a thread and the training engine (``on_engine.run_engine``, objective ``grpo``) on
its own: the replica-group actors train, checkpoint (DCP) and heal as in pretraining.
Per step ``k``:

1. the controller walks batch ``k``; the learner drops every group older than eta
   for step ``k`` (``stale_refused``), saves the fleet's admission state for a resume
   at ``k + 1`` and writes the step's groups as ``rollouts/step-<k>.json``
   (``step_groups``; the ranks make the tensors, ``grpo_objective``);
2. the ranks train step ``k`` on it; rank 0 of the lowest live group publishes the
   committed weights as version ``k + 1`` from its own process (``ray.put`` there, or
   the collective broadcast it runs) and leaves a descriptor and the loss on the
   run's weight board (``stages.post_training.weight_board``);
3. the learner takes that descriptor and the controller forwards it to every worker's
   ``set_weights`` while the fleet keeps generating. The driver never holds the
   tensors: version 0 is the base folder, which every worker loads itself.

A relaunched driver resumes at the engine's newest checkpoint ``c``: the batches
after ``c`` are discarded before any rank starts (nothing trained them into a
checkpoint), the controller restarts from its state saved for ``c``, and the fleet
gets version ``c`` back from the restored ranks (a process publishes the version it
starts from), so no sample older than eta for its step is ever trained.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stages.atomic_write import write_text
from stages.base import StageContext
from stages.errors import ErrorCode, ItoError
from stages.evals.objective_eval import ObjectiveEvalReply, ObjectiveEvalRequest
from stages.post_training.admission import is_stale
from stages.post_training.config import OBJECTIVE_BUILDER, TRL_ADAM_BETAS, RLVRConfig
from stages.post_training.rollout import PromptEncoding, RolloutGroup
from stages.post_training.step_groups import step_groups, write_step_groups
from stages.post_training.weight_descriptors import BaseWeights, PublishedVersion
from stages.trainer.config import GRPOSettings, ObjectiveConfig, TrainStageConfig

if TYPE_CHECKING:
    from stages.post_training.pools import WorkerPool
    from stages.post_training.rl import RequestMaker, RLResult, StepStats
    from stages.trainer.fleet.handoff import Fleet

CONTROLLER_DIR = "controller"


class EngineLearner:
    """``run_rlvr``'s learner when the engine's ranks train (see the module docstring).

    ``trained`` records (step, sample version) of every group written into a batch;
    the ranks train exactly those files. ``published`` records what the ranks handed
    over per version: descriptors only (the driver never holds a policy tensor)."""

    def __init__(
        self,
        cfg: RLVRConfig,
        work: Path,
        *,
        pad_id: int,
        base: Path,
        engine_done: threading.Event,
        step_timeout_s: float,
        board: Any,
    ):
        self.cfg = cfg
        self.pad_id = pad_id
        self.base = base
        self.rollouts = work / "rollouts"
        self.controller = work / CONTROLLER_DIR
        self.ckpt_dir = work / "checkpoints"
        self.engine_done = engine_done
        self.step_timeout_s = step_timeout_s
        self.board = board
        self.version = 0
        self.trained: list[tuple[int, int]] = []
        self.losses: dict[int, float] = {}
        self.published: dict[int, PublishedVersion] = {}

    def _checkpoint_steps(self) -> list[int]:
        from stages.checkpointing.storage import list_checkpoints

        return [r.step for r in list_checkpoints(self.ckpt_dir)]

    def state(self) -> PublishedVersion | BaseWeights:
        """What the fleet gets as ``version``: the base folder at 0 (each worker loads
        it), else the descriptor the ranks published."""
        if self.version == 0:
            return BaseWeights(model_dir=str(self.base))
        return self._take(self.version)

    def delivered(self, version: int) -> None:
        """Every worker has ``version`` (its publisher may exit now)."""
        import ray

        ray.get(self.board.release.remote(version), timeout=self.step_timeout_s)

    def _take(self, version: int) -> PublishedVersion:
        from stages.post_training.weight_board import take

        if version not in self.published:
            try:
                self.published[version] = take(
                    self.board, version, self.step_timeout_s, self.engine_done.is_set
                )
            except InterruptedError:
                raise ItoError(
                    ErrorCode.training_failed,
                    f"post_training.rlvr: the learner stopped before version {version}",
                ) from None
            except TimeoutError:
                raise ItoError(
                    ErrorCode.training_failed,
                    f"post_training.rlvr: version {version} not trained within "
                    f"{self.step_timeout_s:.0f}s",
                ) from None
            for old in [v for v in self.published if v < version]:
                del self.published[old]  # refs the driver no longer forwards
        return self.published[version]

    # -- resume ------------------------------------------------------------------------
    def newest_checkpoint(self) -> int:
        steps = self._checkpoint_steps()
        return steps[-1] if steps else 0

    def discard_after_checkpoint(self) -> int:
        """Before any rank starts: drop every batch from the newest checkpoint's step on
        (nothing after it was checkpointed; the batches are regenerated). Returns that
        step."""
        c = self.newest_checkpoint()
        for p in self.rollouts.glob("step-*.json"):
            if int(p.stem.removeprefix("step-")) >= c:
                p.unlink()
        return c

    def load_resume(self, workdir: Path) -> dict[str, Any] | None:
        """The controller's state saved for the engine's newest checkpoint (the ranks
        resume there), or None at step 0."""
        c = self.newest_checkpoint()
        if c == 0:
            return None
        path = self.controller / f"step-{c:08d}.json"
        if not path.exists():
            raise ItoError(
                ErrorCode.checkpoint_not_found,
                f"post_training.rlvr: no controller state beside checkpoint step {c}",
            )
        saved: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        self.version = c
        return saved

    def prepare(self, step: int, progress: dict[str, Any]) -> None:
        """The fleet's state for a resume at ``step``, saved before any rank can train
        (and so checkpoint) ``step``."""
        self.controller.mkdir(parents=True, exist_ok=True)
        path = self.controller / f"step-{step:08d}.json"
        # Durable: a checkpoint of ``step`` (fsynced) is only resumable beside this file.
        write_text(path, json.dumps({"step": step, **progress}))

    def save(self, workdir: Path, step: int, progress: dict[str, Any]) -> None:
        """Nothing: the engine checkpoints the policy; ``prepare`` saved the rest."""

    # -- one step ----------------------------------------------------------------------
    def step(self, batch: list[RolloutGroup]) -> StepStats:
        from stages.post_training.rl import StepStats

        k = self.version
        fresh = [g if not is_stale(k, g.version, self.cfg.max_staleness) else None for g in batch]
        kept = [g for g in fresh if g is not None]
        doc = step_groups(k, fresh, self.cfg, self.pad_id)
        write_step_groups(doc, self.rollouts)
        self.trained += [(k, g.version) for g in kept]
        published = self._take(k + 1)
        self.version = k + 1
        self.losses[k + 1] = published.loss
        self._prune()
        return StepStats(
            loss=self.losses[k + 1],
            tokens=doc.trained_tokens(),
            mean_reward=0.0,
            staleness=[k - g.version for g in kept],
            stale_refused=len(batch) - len(kept),
        )

    def _prune(self) -> None:
        """Keep the batches a restore may re-read (from the oldest complete checkpoint
        on)."""
        kept = self._checkpoint_steps()
        if not kept:
            return
        for p in self.rollouts.glob("step-*.json"):
            if int(p.stem.removeprefix("step-")) < kept[0]:
                p.unlink(missing_ok=True)


def rlvr_train_config(
    cfg: RLVRConfig,
    *,
    base: Path,
    work: Path,
    max_prompt_tokens: int,
    train: TrainStageConfig | None,
    device: Literal["cpu", "cuda"],
    weights_board: str | None = None,
    fleet_workers: int = 0,
) -> TrainStageConfig:
    """The engine config of the rlvr objective: ``groups_per_step x group_size``
    completions per step, the recipe's loss settings, DCP checkpoints every
    ``checkpoint_every_steps`` (and at the end); rank 0 publishes each version to
    ``weights_board`` for ``fleet_workers`` workers (None: no fleet, e.g. the learner
    benchmark)."""
    from stages.post_training.on_engine import engine_config

    settings = GRPOSettings(
        epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        temperature=cfg.temperature,
        is_truncation=cfg.is_truncation if cfg.is_correction == "decoupled" else None,
        beta=cfg.beta,
        batch_wait_timeout_s=cfg.rollout_timeout_s + cfg.worker_restart_timeout_s,
        weights_board=weights_board,
        weight_sync=cfg.weight_sync,
        fleet_workers=fleet_workers if weights_board is not None else 0,
        weight_sync_bucket_bytes=cfg.weight_sync_bucket_mb << 20,
        weight_sync_timeout_s=cfg.weight_sync_timeout_s,
    )
    return engine_config(
        ObjectiveConfig(
            kind="grpo",
            builder=OBJECTIVE_BUILDER,
            data_path=str(work / "rollouts"),
            grpo=settings,
            batch_size=cfg.groups_per_step * cfg.group_size,
            max_length=max(8, max_prompt_tokens + cfg.max_completion_tokens),
        ),
        steps=cfg.steps,
        learning_rate=cfg.learning_rate,
        # AdamW's defaults, as trl's GRPOTrainer trains.
        adam_betas=TRL_ADAM_BETAS,
        checkpoint_every=cfg.checkpoint_every_steps or cfg.steps,
        base=base,
        checkpoint_dir=work / "checkpoints",
        train=train,
        device=device,
        name="rlvr",
    )


@dataclass
class RLVRSide:
    """RLVR's driver-side actors, started while the objectives before it train: the
    rollout pool, worker 0's encoding of the prompts (collected at RLVR's start, with
    its timeout), and the weight board (name, actor)."""

    pool: WorkerPool
    prompts: Callable[[float], PromptEncoding]
    board: tuple[str, Any]

    def close(self) -> None:
        import ray

        self.pool.close()
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.board[1], no_restart=True)


def run_rlvr_on_engine(
    cfg: RLVRConfig,
    ctx: StageContext,
    *,
    stage: str,
    base: Path,
    export_dir: Path,
    train: TrainStageConfig | None,
    device: Literal["cpu", "cuda"],
    pool: WorkerPool,
    maker: RequestMaker,
    pad_id: int,
    on_interruption: Callable[[int, float, float, str], None] | None = None,
    board_placement: dict[str, Any] | None = None,
    scoring: ObjectiveEvalRequest | None = None,
    fleet: Fleet | None = None,
    board: tuple[str, Any] | None = None,
) -> tuple[RLResult, Path, EngineLearner, ObjectiveEvalReply | None]:
    """Train the rlvr objective on the engine, fed by the fleet; returns (``RLResult``, the
    HF export of the final weights, the learner, ``scoring``'s scores from the
    evaluating rank). ``board_placement``: the weight board's actor options (the run's
    placement group; it reserves no CPU); ``fleet``: the learner ranks the previous
    objective left (``stages.trainer.fleet.handoff``); ``board``: a weight board (name,
    actor) started ahead (its process spawn off RLVR's start), else one is started
    here; it is killed at the end either way."""
    import ray

    from stages.post_training.on_engine import run_engine
    from stages.post_training.rl import run_rlvr
    from stages.post_training.weight_board import (
        BOARD_CALL_TIMEOUT_S,
        board_name,
        start_board,
    )
    from stages.post_training.weight_sync import sync_key
    from stages.trainer.fleet.engine import RunCancelled

    work = ctx.workdir / "rlvr"
    if board is None:
        name = board_name(ctx.run_id, uuid.uuid4().hex[:8])
        key = sync_key(ctx.secret)
        board = (name, start_board(name, 1, placement=board_placement, sync_key=key))
    name = board[0]
    tcfg = rlvr_train_config(
        cfg,
        base=base,
        work=work,
        max_prompt_tokens=max((len(p) for p, _ in maker.prompts), default=0),
        train=train,
        device=device,
        weights_board=name,
        fleet_workers=pool.size,
    )
    engine_done, stop = threading.Event(), threading.Event()
    learner = EngineLearner(
        cfg,
        work,
        pad_id=pad_id,
        base=base,
        engine_done=engine_done,
        step_timeout_s=tcfg.objective.grpo.batch_wait_timeout_s,  # type: ignore[union-attr]
        board=None,
    )
    box: dict[str, Any] = {}

    def drive() -> None:
        try:
            box["result"], _ = run_rlvr(
                cfg,
                learner,
                pool,
                maker,
                emit=ctx.emit,
                cancelled=lambda: ctx.cancelled or engine_done.is_set(),
                on_interruption=on_interruption,
                workdir=work,
            )
        except BaseException as e:  # surfaced by the engine's side below
            box["error"] = e
            stop.set()
        finally:
            # Nothing more will be delivered: a rank waiting at the last version goes on.
            learner.board.release.remote(cfg.steps)

    resume = learner.discard_after_checkpoint()  # before any rank can read a batch
    # Version 0 is the base folder: the board wants the ranks' versions from 1 on, or
    # from the checkpoint a relaunch resumes at.
    ray.get(board[1].begin_at.remote(max(resume, 1)), timeout=BOARD_CALL_TIMEOUT_S)
    learner.board = board[1]
    thread = threading.Thread(target=drive, name="rlvr-controller", daemon=True)

    def cancel_watch() -> None:
        while not stop.is_set() and not engine_done.is_set():
            if ctx.cancelled:
                stop.set()
            time.sleep(0.1)

    watcher = threading.Thread(target=cancel_watch, name="rlvr-cancel", daemon=True)
    thread.start()
    watcher.start()
    try:
        exported, _, scores = run_engine(
            tcfg,
            ctx,
            stage=stage,
            base=base,
            work=work,
            export_dir=export_dir,
            cancel_event=stop,
            scoring=scoring,
            fleet=fleet,
        )
    except RunCancelled:
        if "error" in box:
            raise box["error"] from None
        raise
    finally:
        engine_done.set()
        thread.join()
        watcher.join()
        ray.kill(learner.board, no_restart=True)
    if "error" in box:
        raise box["error"]
    return box["result"], exported, learner, scores
