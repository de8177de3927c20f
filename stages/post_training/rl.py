"""RLVR's loop: the rollout controller feeds the learner (``run_rlvr``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stages.errors import ErrorCode, ItoError
from stages.events import Event, MetricsEvent
from stages.post_training.config import RLVRConfig
from stages.post_training.fleet import DynamicSampler, RolloutController
from stages.post_training.pools import WorkerPool
from stages.post_training.rollout import PromptEncoding, RolloutGroup, RolloutRequest

if TYPE_CHECKING:
    from stages.post_training.weight_descriptors import PolicyWeights


class RequestMaker:
    """Request ``k`` is always the same prompt with the same seed."""

    def __init__(self, cfg: RLVRConfig, prompts: PromptEncoding, rows: list[dict[str, Any]]):
        self.cfg = cfg
        encoded = list(zip(prompts.ids, (r["answer"] for r in rows), strict=True))
        self.prompts = [(ids, a) for ids, a in encoded if len(ids) <= cfg.max_prompt_tokens]
        if not self.prompts:
            raise ItoError(
                ErrorCode.data_empty,
                f"post_training.rlvr: all {len(rows)} prompts are longer than "
                f"max_prompt_tokens {cfg.max_prompt_tokens}",
            )
        self.order = list(range(len(self.prompts)))
        random.Random(cfg.seed).shuffle(self.order)

    def __call__(self, k: int, consume_step: int) -> RolloutRequest:
        ids, answer = self.prompts[self.order[k % len(self.order)]]
        return RolloutRequest(
            id=k,
            prompt_ids=ids,
            answer=answer,
            group_size=self.cfg.group_size,
            seed=self.cfg.seed * 1_000_003 + k,
            consume_step=consume_step,
            max_staleness=self.cfg.max_staleness,
            max_new_tokens=self.cfg.max_completion_tokens,
            temperature=self.cfg.temperature,
        )


@dataclass
class StepStats:
    loss: float
    tokens: int
    mean_reward: float
    staleness: list[int]
    stale_refused: int = 0  # groups the learner itself refused as older than eta


@dataclass
class RLResult:
    steps: int
    rewards: list[float] = field(default_factory=list)  # mean task reward per step
    summary: dict[str, float] = field(default_factory=dict)
    resumed_from: int | None = None  # the step of the resume state this run started from


def _metrics_event(
    step: int, stats: StepStats, summary: dict[str, float], sync_s: list[float]
) -> MetricsEvent:
    st = stats.staleness or [0]
    values = {
        **summary,
        # The newest completed sync (publish to the slowest worker's load), this path.
        "sync_s": sync_s[-1] if sync_s else 0.0,
        "loss": stats.loss,
        "mean_reward": stats.mean_reward,
        "step_staleness_max": float(max(st)),
    }
    return MetricsEvent(stage="post_training", step=step, scope="rlvr", values=values)


class Learner(Protocol):
    """What ``run_rlvr`` trains with: ``stages.post_training.learner.EngineLearner``
    (the training engine's replica groups); the controller's tests give it a small
    in-process one (``tests/helpers/in_process_learner.py``)."""

    version: int
    trained: list[tuple[int, int]]

    def state(self) -> PolicyWeights: ...  # what the fleet gets: a state dict or a descriptor
    def delivered(self, version: int) -> None: ...
    def step(self, batch: list[RolloutGroup]) -> StepStats: ...
    def load_resume(self, workdir: Path) -> dict[str, Any] | None: ...
    def prepare(self, step: int, progress: dict[str, Any]) -> None: ...
    def save(self, workdir: Path, step: int, progress: dict[str, Any]) -> None: ...


def run_rlvr(
    cfg: RLVRConfig,
    learner: Learner,
    pool: WorkerPool,
    maker: RequestMaker,
    *,
    emit: Callable[[Event], None] = lambda _e: None,
    cancelled: Callable[[], bool] = lambda: False,
    on_interruption: Callable[[int, float, float, str], None] | None = None,
    workdir: Path | None = None,
) -> tuple[RLResult, RolloutController]:
    """The asynchronous loop: the fleet generates while the learner trains.

    With a ``workdir`` the learner saves what a resume needs (``EngineLearner``: the
    fleet's admission state of every step, beside the engine's checkpoints) and a rerun
    with the same workdir resumes from the newest state."""
    ctl = RolloutController(
        pool,
        maker,
        groups_per_step=cfg.groups_per_step,
        max_staleness=cfg.max_staleness,
        sampler=DynamicSampler(cfg.dynamic_sampling, cfg.max_dropped_groups_per_step),
        rollout_timeout_s=cfg.rollout_timeout_s,
        restart_timeout_s=cfg.worker_restart_timeout_s,
        on_interruption=on_interruption,
    )
    result = RLResult(steps=0)
    saved = learner.load_resume(workdir) if workdir is not None else None
    if saved is not None:
        ctl.restore(saved["fleet"])
        result.rewards, result.steps = list(saved["rewards"]), int(saved["step"])
        result.resumed_from = result.steps
    ctl.publish(learner.version, learner.state())
    for step in range(result.steps, cfg.steps):
        if cancelled():
            break
        batch, walked = ctl.next_batch()
        task = [r for g in walked for r in g.task_rewards]
        mean_reward = sum(task) / len(task)
        # What a resume at step + 1 needs, known before the step can be checkpointed.
        learner.prepare(
            step + 1,
            {
                "fleet": {**ctl.resume_state(), "version": step + 1},
                "rewards": [*result.rewards, mean_reward],
            },
        )
        stats: StepStats = ctl.pump_while(partial(learner.step, batch))  # fleet keeps going
        ctl.stats.stale_refused += stats.stale_refused
        ctl.publish(learner.version, learner.state())
        stats.mean_reward = mean_reward
        result.rewards.append(stats.mean_reward)
        result.steps = step + 1
        if workdir is not None:
            progress = {"fleet": ctl.resume_state(), "rewards": result.rewards}
            learner.save(workdir, step + 1, progress)
        emit(_metrics_event(step + 1, stats, ctl.stats.summary(pool.size), ctl.stats.sync_s))
    # Account for every worker before reporting: a death is seen by the last sync at
    # the latest, and its restart and re-sync are counted as an interruption.
    ctl.drain_syncs(cfg.worker_restart_timeout_s)
    learner.delivered(learner.version)
    result.summary = ctl.stats.summary(pool.size)
    if result.resumed_from is not None:
        result.summary["resumed_from_step"] = float(result.resumed_from)
    return result, ctl


__all__ = [
    "Learner",
    "RLResult",
    "RequestMaker",
    "run_rlvr",
    "time",
]
