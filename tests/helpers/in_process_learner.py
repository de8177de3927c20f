"""A small in-process GRPO learner: the learner of the rollout controller's tests.

``run_rlvr`` needs a learner. The product's is the training engine's
(``stages.post_training.learner.EngineLearner``: replica groups training
``grpo_objective.GRPOObjective``); this one trains the policy in the test's own process
on one device, so the controller's tests (staleness, refills, resume, eta = 0 against
``run_synchronous``) need no engine. Its update is the engine's: the step's batch comes
from the engine's ``assemble``, its loss is ``GRPOObjective.loss_sum`` (built on
``stages.post_training.losses``) with the settings the engine gets for the recipe.
``run_synchronous`` is the reference loop: one worker, generate in id order, then train.
Test code: nothing under ``stages`` uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers.rlvr_resume import load_newest, save_resume
from stages.post_training.admission import is_stale
from stages.post_training.config import RLVRConfig
from stages.post_training.fleet import DynamicSampler
from stages.post_training.rl import RequestMaker, RLResult, StepStats
from stages.post_training.rollout import RolloutGroup


class GRPOLearner:
    """One AdamW update per batch, one forward over the whole batch.

    Like the engine's learner, it re-checks every group's version against eta before it
    trains on it, whatever the fleet's admission said: refused groups are dropped and
    counted; ``trained`` records (version trained at, sample version) for every group
    that reached the optimizer."""

    def __init__(self, cfg: RLVRConfig, model: Any, pad_id: int):
        if cfg.beta > 0:  # the KL term needs a frozen reference, which this one lacks
            raise ValueError("the in-process learner has no KL term (beta must be 0)")
        self.cfg = cfg
        self.model = model
        self.pad_id = pad_id
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.learning_rate, weight_decay=0.0, foreach=False
        )
        self.version = 0
        self.trained: list[tuple[int, int]] = []

    def state(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def delivered(self, version: int) -> None:
        """Nothing: this process keeps its weights."""

    def load_resume(self, workdir: Path) -> dict[str, Any] | None:
        """The newest saved state (restored here), with the fleet's and the rewards."""
        saved = load_newest(workdir) if self.cfg.checkpoint_every_steps else None
        if saved is not None:
            self.model.load_state_dict(saved["model"])
            self.opt.load_state_dict(saved["optimizer"])
            self.version = int(saved["version"])
        return saved

    def prepare(self, step: int, progress: dict[str, Any]) -> None:
        """Nothing: ``save`` writes the whole state after the step."""

    def save(self, workdir: Path, step: int, progress: dict[str, Any]) -> None:
        every = self.cfg.checkpoint_every_steps
        if every and step % every == 0:
            own = {"version": self.version, "model": self.state()}
            save_resume(workdir, step, {**own, "optimizer": self.opt.state_dict(), **progress})

    def step(self, batch: list[RolloutGroup]) -> StepStats:
        from stages.post_training.grpo_objective import GRPOObjective, assemble
        from stages.post_training.learner import rlvr_train_config
        from stages.post_training.step_groups import step_groups

        cfg = self.cfg
        fresh = [g for g in batch if not is_stale(self.version, g.version, cfg.max_staleness)]
        refused = len(batch) - len(fresh)
        if not fresh:  # nothing fresh: no update, the version still advances
            self.version += 1
            return StepStats(
                loss=0.0, tokens=0, mean_reward=0.0, staleness=[], stale_refused=refused
            )
        # The loss settings the engine gets for this recipe (the paths are never read).
        unused = Path("unused")
        engine = rlvr_train_config(
            cfg,
            base=unused,
            work=unused,
            max_prompt_tokens=cfg.max_prompt_tokens,
            train=None,
            device="cpu",
        )
        objective = GRPOObjective(engine.objective.grpo, unused, dp_rank=0, dp_world=1)
        tensors = assemble(step_groups(self.version, list(fresh), cfg, self.pad_id))
        tokens = int(tensors["mask"].sum())
        self.model.train()
        logits = self.model(input_ids=tensors["input_ids"]).logits
        loss = objective.loss_sum(logits, tensors) / max(tokens, 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.trained += [(self.version, g.version) for g in fresh]
        self.version += 1
        task = [r for g in fresh for r in g.task_rewards]
        return StepStats(
            loss=float(loss.detach()),
            tokens=tokens,
            mean_reward=sum(task) / len(task),
            staleness=[self.version - 1 - g.version for g in fresh],
            stale_refused=refused,
        )


def run_synchronous(
    cfg: RLVRConfig, learner: GRPOLearner, worker: Any, maker: RequestMaker
) -> RLResult:
    """The reference loop: one in-process worker, generate in id order, then train."""
    sampler = DynamicSampler(cfg.dynamic_sampling, cfg.max_dropped_groups_per_step)
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
        learner.step(batch)
        worker.set_weights(
            learner.version, {k2: v.detach().clone() for k2, v in learner.state().items()}
        )
        result.steps = step + 1
    return result
