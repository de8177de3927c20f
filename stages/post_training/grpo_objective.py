"""The GRPO/DAPO learner as an objective of the training engine.

The driver's rollout controller hands over step ``k``'s groups (every group already
checked against eta for step ``k``) as ``<rollouts>/step-<k>.json``
(``stages.post_training.step_groups``); ``batch(k)`` waits for that file, turns it
into tensors (``assemble``: advantages, padding, masks, here on the rank, so the
driver builds no tensor) and takes the rank's data-parallel slice. The file is never
rewritten while ranks may read it, so ``batch(k)`` stays a pure function of ``k``: a
retried step, a healed group and a checkpoint restore re-read the same bytes.

One step, one global batch of ``N`` completions, right-padded to one length ``L``
(prompt + completion; causal attention, so the padding never reaches a real token):

- ``input_ids`` [N, L]; ``targets`` [N, L]: position t's next token;
- ``mask`` [N, L]: 1 where position t predicts a trained completion token;
- ``behav_logp`` [N, L]: the behaviour policy's log-prob of that token;
- ``advantages`` [N]; ``lengths`` [N]: real tokens of the row; ``versions`` [N]: the
  policy version each sample came from (rows of a group refused as stale are all
  padding: mask 0, length 0, version -1).

The loss is ``losses.dapo_token_loss`` summed over the rank's masked tokens; the
denominator is the global batch's mask count over the data-parallel ranks, so the
update is DAPO's token-level mean over the whole batch whatever the number of
groups. After a committed step the lowest live group's rank 0 publishes the new
weights as version ``step`` for the rollout fleet from its own process
(``stages.post_training.weight_board``); the driver only forwards a descriptor. A
process also publishes the version it starts from at its first batch (a resume's
fleet starts there). The grpo phase never skips data windows, so the data index of a
batch is its step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stages.errors import ErrorCode, ItoError
from stages.post_training.losses import (
    aggregate,
    dapo_token_loss,
    group_advantages,
    token_logprobs,
)
from stages.post_training.step_groups import StepGroups, step_groups_path
from stages.trainer.rank.objective import Batch, LaidOutModel, Tensors

if TYPE_CHECKING:
    from stages.trainer.config import GRPOSettings, TrainStageConfig
    from stages.trainer.rank.loop import TrainLoop

# How often a rank looks for the file it waits for (the wait itself is bounded by
# ``GRPOSettings.batch_wait_timeout_s``).
POLL_S = 0.02
BATCH_KEYS = (
    "input_ids",
    "targets",
    "mask",
    "behav_logp",
    "advantages",
    "lengths",
    "versions",
)


def wait_for(path: Path, timeout_s: float, what: str) -> StepGroups:
    """The step's groups once the driver wrote them."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise ItoError(
                ErrorCode.rollout_fleet_failed, f"{what} not written within {timeout_s:.0f}s"
            )
        time.sleep(POLL_S)
    return StepGroups.model_validate_json(path.read_text(encoding="utf-8"))


def assemble(doc: StepGroups) -> dict[str, torch.Tensor]:
    """One step's global batch in the layout above, from its groups."""
    live = [g for g in doc.groups if g is not None]
    adv = (
        group_advantages(torch.tensor([g.rewards for g in live]), scale=doc.scale_rewards)
        if live
        else torch.zeros(0, doc.group_size)
    )
    rows: list[tuple[list[int], int, list[int], list[float], float, bool, int]] = []
    a_iter = iter(adv)
    for g in doc.groups:
        if g is None:
            rows += [([], 0, [], [], 0.0, True, -1)] * doc.group_size
            continue
        a = next(a_iter)
        for i, (ids, lp) in enumerate(zip(g.completion_ids, g.behav_logp, strict=True)):
            masked = doc.mask_truncated_completions and g.truncated[i]
            rows.append((g.prompt_ids, len(g.prompt_ids), ids, lp, float(a[i]), masked, g.version))
    width = max([len(p) + len(c) for p, _, c, _, _, _, _ in rows] + [2])
    n = len(rows)
    out = {
        "input_ids": torch.full((n, width), doc.pad_id, dtype=torch.long),
        "targets": torch.full((n, width), doc.pad_id, dtype=torch.long),
        "mask": torch.zeros(n, width),
        "behav_logp": torch.zeros(n, width),
        "advantages": torch.zeros(n),
        "lengths": torch.zeros(n, dtype=torch.long),
        "versions": torch.full((n,), -1, dtype=torch.long),
    }
    for r, (prompt, p, comp, lp, a, masked, version) in enumerate(rows):
        seq = torch.tensor(prompt + comp, dtype=torch.long)
        m = len(seq)
        out["input_ids"][r, :m] = seq
        out["targets"][r, : max(m - 1, 0)] = seq[1:]
        c = len(comp)
        if c:  # position p - 1 + j predicts completion token j
            out["behav_logp"][r, p - 1 : p - 1 + c] = torch.tensor(lp)
            if not masked:
                out["mask"][r, p - 1 : p - 1 + c] = 1.0
        out["advantages"][r] = a
        out["lengths"][r] = m
        out["versions"][r] = version
    return out


class GRPOObjective:
    name = "grpo"

    def __init__(
        self,
        settings: GRPOSettings,
        rollouts: Path,
        *,
        dp_rank: int,
        dp_world: int,
        reference: torch.nn.Module | None = None,
        device: torch.device | None = None,
        parallel: LaidOutModel | None = None,
    ):
        from stages.post_training.weight_board import RankPublisher

        self.s = settings
        self.rollouts = rollouts
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.reference = reference  # frozen base weights, only when beta > 0
        self.device = device or torch.device("cpu")
        self.parallel = parallel  # this rank's model (ParallelModel), for publishing
        self.publisher = RankPublisher(settings, self.device.type)
        self._started = False
        self._cached: tuple[int, Batch] | None = None

    def batch(self, index: int) -> Batch:
        if self._cached is not None and self._cached[0] == index:
            return dataclasses.replace(self._cached[1], waited_s=0.0)  # a retry waits not
        if not self._started:  # before waiting: a resumed fleet needs this version first
            self._started = True
            self._publish_start(index)
        t0 = time.monotonic()
        doc = wait_for(
            step_groups_path(self.rollouts, index),
            self.s.batch_wait_timeout_s,
            f"rollout batch {index}",
        )
        waited = time.monotonic() - t0
        whole = assemble(doc)
        n = int(whole["input_ids"].shape[0])
        per = n // self.dp_world
        mine = {k: whole[k][self.dp_rank * per : (self.dp_rank + 1) * per] for k in BATCH_KEYS}
        mine["mask"] = mine["mask"].float()
        if self.reference is not None:
            with torch.no_grad():
                ids = mine["input_ids"].to(self.device)
                logits = self.reference(input_ids=ids).logits
                ref = token_logprobs(logits, mine["targets"].to(self.device), self.s.temperature)
                mine["ref_logp"] = ref.cpu()
        out = Batch(
            mine,
            denominator=max(float(whole["mask"].sum()), 1.0) / self.dp_world,
            tokens=int(mine["lengths"].sum()),
            waited_s=waited,
        )
        self._cached = (index, out)
        return out

    def model_inputs(self, part: Tensors) -> Tensors:
        return {"input_ids": part["input_ids"]}

    def loss_sum(self, logits: torch.Tensor, part: Tensors) -> torch.Tensor:
        logp = token_logprobs(logits, part["targets"], self.s.temperature)
        decoupled = self.s.is_truncation is not None
        tok = dapo_token_loss(
            logp,
            logp.detach(),  # one update per batch: the proximal policy is this one
            part["behav_logp"] if decoupled else logp.detach(),
            part["advantages"],
            eps_low=self.s.epsilon,
            eps_high=self.s.epsilon_high,
            is_truncation=self.s.is_truncation,
            ref_logp=part.get("ref_logp"),
            beta=self.s.beta,
        )
        return aggregate(tok, part["mask"], 1.0)

    def after_commit(self, step: int, loss: float, loop: TrainLoop) -> None:
        """Publish the weights of committed step ``step`` (version ``step``) for the
        fleet: rank 0 of the group that saves checkpoints (the lowest live one); the
        other ranks of a sharded group take part in gathering the full tensors."""
        if not self.publisher.enabled or not loop.saver.is_saver():
            return
        state = full_state(loop.model)
        if loop.spec.rank == 0:
            self.publisher.publish(step, state, loss, last=step == loop.schedule.total_steps)

    def _publish_start(self, version: int) -> None:
        """The weights this process starts from (restored or healed), if the board
        still wants them: every rank of a sharded group gathers, rank 0 offers."""
        if not self.publisher.enabled or self.parallel is None:
            return
        rank0 = not any(self.parallel.coords.values())
        sharded = any(hasattr(v, "full_tensor") for v in self.parallel.module.state_dict().values())
        if not sharded and not (rank0 and self.publisher.wants(version)):
            return
        state = full_state(self.parallel.module)
        if rank0:
            self.publisher.publish(version, state, math.nan, last=False)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full tensors on its device (a sharded parameter is gathered: a
    collective over the group)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
        for k, v in model.state_dict().items()
    }


def build_grpo_objective(
    cfg: TrainStageConfig,
    *,
    dp_rank: int,
    device: torch.device,
    parallel: LaidOutModel | None = None,
) -> GRPOObjective:
    """The rank's grpo objective (``cfg``: a ``TrainStageConfig``); with beta > 0 a
    frozen copy of the base weights gives the KL term's reference log-probs."""
    obj = cfg.objective
    # ObjectiveConfig: a grpo objective has its settings and its batches' folder.
    assert obj.grpo is not None and obj.data_path is not None
    reference = None
    if obj.grpo.beta > 0:
        from stages.model.lm import build_model
        from stages.presets import load_model_preset

        if cfg.model.checkpoint_path is None:
            raise ItoError(
                ErrorCode.post_training_model_invalid, "the grpo KL term needs a base folder"
            )
        reference = build_model(
            load_model_preset(cfg.model.preset), checkpoint_path=cfg.model.checkpoint_path
        )
        reference = reference.to(device)
        reference.eval().requires_grad_(False)
    return GRPOObjective(
        obj.grpo,
        Path(obj.data_path),
        dp_rank=dp_rank,
        dp_world=cfg.dp_world,
        reference=reference,
        device=device,
        parallel=parallel,
    )
