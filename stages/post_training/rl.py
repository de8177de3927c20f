"""RLVR: the GRPO/DAPO trainer fed by the rollout controller."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from stages.errors import ErrorCode, ItoError
from stages.events import Event, MetricsEvent
from stages.post_training.admission import is_stale
from stages.post_training.config import RLVRConfig
from stages.post_training.fleet import DynamicSampler, FleetStats, RolloutController
from stages.post_training.pools import WorkerPool
from stages.post_training.resume import load_newest, save_resume
from stages.post_training.rollout import RolloutGroup, RolloutRequest


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


class RequestMaker:
    """Request ``k`` is always the same prompt with the same seed."""

    def __init__(self, cfg: RLVRConfig, tokenizer: Any, rows: list[dict[str, Any]]):
        self.cfg = cfg
        encoded = [(prompt_ids(tokenizer, r["prompt"]), r["answer"]) for r in rows]
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


class GRPOLearner:
    """One optimizer update per batch of groups; micro-batch = one group.

    The learner re-checks every group's version against eta before it trains on it,
    whatever the fleet's admission said: a worker that ignores its own check (or a
    sync that raced a rollout) cannot put an older sample into an update. Refused
    groups are dropped and counted; ``trained`` records (version trained at, sample
    version) for every group that reached the optimizer."""

    def __init__(self, cfg: RLVRConfig, model: Any, pad_id: int):
        import copy

        import torch

        self.cfg = cfg
        self.model = model
        self.pad_id = pad_id
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.learning_rate, weight_decay=0.0, foreach=False
        )
        self.ref = copy.deepcopy(model).eval() if cfg.beta > 0 else None
        self.version = 0
        self.trained: list[tuple[int, int]] = []

    def state(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def delivered(self, version: int) -> None:
        """Nothing: this process keeps its weights."""

    def resume_state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": self.state(),
            "optimizer": self.opt.state_dict(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["optimizer"])
        self.version = int(saved["version"])

    # -- the resume hooks of ``run_rlvr`` (the engine's learner: ``EngineLearner``) --
    def load_resume(self, workdir: Path) -> dict[str, Any] | None:
        """The newest saved state (restored here), with the fleet's and the rewards."""
        if not self.cfg.checkpoint_every_steps:
            return None
        saved = load_newest(workdir)
        if saved is not None:
            self.restore(saved)
        return saved

    def prepare(self, step: int, progress: dict[str, Any]) -> None:
        """Nothing: this learner saves its whole state after a step (``save``)."""

    def save(self, workdir: Path, step: int, progress: dict[str, Any]) -> None:
        every = self.cfg.checkpoint_every_steps
        if every and step % every == 0:
            save_resume(workdir, step, {**self.resume_state(), **progress})

    def step(self, batch: list[RolloutGroup]) -> StepStats:
        import torch

        from stages.post_training.losses import group_advantages

        cfg = self.cfg
        offered = len(batch)
        batch = [g for g in batch if not is_stale(self.version, g.version, cfg.max_staleness)]
        refused = offered - len(batch)
        if not batch:  # nothing fresh: no update, the version still advances
            self.version += 1
            return StepStats(
                loss=0.0, tokens=0, mean_reward=0.0, staleness=[], stale_refused=refused
            )
        self.model.train()
        rewards = torch.tensor([g.rewards for g in batch], dtype=torch.float32)
        adv = group_advantages(rewards, scale=cfg.scale_rewards)
        masks = [self._mask(g) for g in batch]
        total = int(sum(int(m.sum()) for m in masks))
        loss_sum = 0.0
        for g, a, mask in zip(batch, adv, masks, strict=True):
            loss = self.group_loss(g, a, mask, total)
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.trained += [(self.version, g.version) for g in batch]
        self.version += 1
        task = [r for g in batch for r in g.task_rewards]
        return StepStats(
            loss=loss_sum,
            tokens=total,
            mean_reward=sum(task) / len(task),
            staleness=[self.version - 1 - g.version for g in batch],
            stale_refused=refused,
        )

    def _mask(self, g: RolloutGroup) -> Any:
        import torch

        width = max(g.lengths)
        mask = torch.zeros(len(g.lengths), width)
        for i, n in enumerate(g.lengths):
            if not (self.cfg.mask_truncated_completions and g.truncated[i]):
                mask[i, :n] = 1.0
        return mask

    def group_loss(self, g: RolloutGroup, adv: Any, mask: Any, total_tokens: int) -> Any:
        import torch

        from stages.post_training.losses import aggregate, dapo_token_loss, token_logprobs

        width = mask.shape[1]
        comp = torch.full((len(g.lengths), width), self.pad_id, dtype=torch.long)
        behav = torch.zeros(len(g.lengths), width)
        for i, (ids, lp) in enumerate(zip(g.completion_ids, g.behav_logp, strict=True)):
            comp[i, : len(ids)] = torch.tensor(ids)
            behav[i, : len(lp)] = torch.tensor(lp)
        prompt = torch.tensor([g.prompt_ids] * len(g.lengths), dtype=torch.long)
        seq = torch.cat([prompt, comp], dim=1)
        p = prompt.shape[1]
        logits = self.model(input_ids=seq).logits[:, p - 1 : -1]
        logp = token_logprobs(logits, comp, self.cfg.temperature)
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(
                    self.ref(input_ids=seq).logits[:, p - 1 : -1], comp, self.cfg.temperature
                )
        decoupled = self.cfg.is_correction == "decoupled"
        tok = dapo_token_loss(
            logp,
            logp.detach(),
            behav if decoupled else logp.detach(),
            adv,
            eps_low=self.cfg.epsilon,
            eps_high=self.cfg.epsilon_high,
            is_truncation=self.cfg.is_truncation if decoupled else None,
            ref_logp=ref_logp,
            beta=self.cfg.beta,
        )
        return aggregate(tok, mask, total_tokens)


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
    """What ``run_rlvr`` trains with: ``GRPOLearner`` (in this process, one device) or
    ``EngineLearner`` (the training engine's replica groups)."""

    version: int
    trained: list[tuple[int, int]]

    def state(self) -> Any: ...  # what the fleet gets: a state dict or a descriptor
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

    With a ``workdir`` the learner saves what a resume needs (``GRPOLearner``: every
    ``checkpoint_every_steps``; ``EngineLearner``: the fleet's admission state of every
    step, beside the engine's checkpoints) and a rerun with the same workdir resumes
    from the newest state."""
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


def run_synchronous(
    cfg: RLVRConfig, learner: GRPOLearner, worker: Any, maker: RequestMaker
) -> RLResult:
    """The reference loop: one in-process worker, generate in id order, then train."""
    sampler = DynamicSampler(cfg.dynamic_sampling, cfg.max_dropped_groups_per_step)
    stats = FleetStats()
    worker.set_weights(0, {k: v.detach().clone() for k, v in learner.state().items()})
    k = 0
    result = RLResult(steps=0)
    for step in range(cfg.steps):
        batch: list[RolloutGroup] = []
        sampler.reset()
        while len(batch) < cfg.groups_per_step:
            g = worker.generate(maker(k, step))
            k += 1
            if sampler.offer(g.rewards):
                batch.append(g)
            else:
                stats.groups_dropped += 1
        learner.step(batch)
        worker.set_weights(
            learner.version, {k2: v.detach().clone() for k2, v in learner.state().items()}
        )
        result.steps = step + 1
    return result


__all__ = [
    "GRPOLearner",
    "Learner",
    "RLResult",
    "RequestMaker",
    "run_rlvr",
    "run_synchronous",
    "time",
]
