"""What a run trains for: an objective gives the loop its batches and its loss; the
engine does the rest (layout, micro-batches, torchft allreduce, commit, checkpoints).

The seam, in one step of one data-parallel rank:

1. ``objective.batch(index)``: the rank's batch of data index ``index`` (a pure function
   of the index, so retry, heal, restore and skip stay one seek): a dict of tensors
   whose dim 0 counts the rank's *units* (sequences, or preference pairs), and the
   rank's share of the loss's denominator;
2. per micro-batch (a dim-0 slice), ``objective.model_inputs(part)`` are the model's
   keyword arguments (``input_ids`` of shape ``[N, L]``, optionally an attention
   mask), and ``objective.loss_sum(logits, part)`` the loss *summed* over the part.

``ParallelModel.forward_backward`` backpropagates ``loss_sum / denominator`` of every
micro-batch. ``denominator`` is the global batch's count (tokens with a target, or
pairs) divided by the run's data-parallel ranks, so that after the gradient average
over ranks and groups the update is that of the whole batch's mean, whatever the
micro-batching or the number of groups (the objective knows the global count without
a collective: the data is indexed by step, so every rank can count every rank's batch).

The language-model pretraining loss is the ``lm`` objective (``LanguageModelObjective``);
SFT, DPO and GRPO live in ``stages.post_training``: a post-training config names its
builder (``ObjectiveConfig.builder``), and each rank calls it (``named_builder``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from stages.trainer.config import TrainStageConfig
    from stages.trainer.rank.mix import MixedLoader

Tensors = dict[str, torch.Tensor]


@dataclass
class Batch:
    """One rank's batch of one step."""

    tensors: Tensors
    # The rank's share of the global batch's loss denominator (global count / dp ranks).
    denominator: float
    # Tokens this rank trains on (throughput accounting).
    tokens: int
    # Seconds the rank waited for this batch's data to exist (the rollout fleet's
    # groups): idle time, not the step's own.
    waited_s: float = 0.0

    @property
    def seq_len(self) -> int:
        return int(self.tensors["input_ids"].shape[-1])

    def to(self, device: torch.device) -> Batch:
        moved = {k: v.to(device) for k, v in self.tensors.items()}
        return Batch(moved, self.denominator, self.tokens, self.waited_s)

    def split(self, n: int) -> list[Tensors]:
        """``n`` dim-0 micro-batches, equal where ``n`` divides the rows (the plan's), else
        the first ones a row longer (a share a resize grew)."""
        chunks = {k: v.tensor_split(n) for k, v in self.tensors.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(n)]


class Objective(Protocol):
    """A training objective (see the module docstring)."""

    name: str

    def batch(self, index: int) -> Batch: ...

    def model_inputs(self, part: Tensors) -> Tensors: ...

    def loss_sum(self, logits: torch.Tensor, part: Tensors) -> torch.Tensor: ...


class LaidOutModel(Protocol):
    """What an objective reads of the rank's laid-out model (``ParallelModel``, which
    imports this module: the protocol keeps the import one way)."""

    coords: dict[str, int]
    module: nn.Module

    def forward_logits(self, inputs: Tensors) -> torch.Tensor: ...


class ObjectiveBuilder(Protocol):
    """Builds a post-training objective on a rank: ``cfg`` its ``TrainStageConfig``,
    ``parallel`` the laid-out model (DPO scores its reference with it)."""

    def __call__(
        self, cfg: TrainStageConfig, parallel: LaidOutModel, *, dp_rank: int, device: torch.device
    ) -> Objective: ...


def named_builder(ref: str) -> ObjectiveBuilder:
    """The builder ``ref`` names ("stages.<module>:<function>", checked by the config)."""
    module, _, name = ref.partition(":")
    builder: ObjectiveBuilder = getattr(importlib.import_module(module), name)
    return builder


def shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets aligned with the input positions (-100: no target), so that
    a sequence can be cut into pipeline micro-batches or CP shards as it is."""
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 over the positions with a target
    (``labels`` pre-shifted: position t's target is token t+1, -100 none)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


class LanguageModelObjective:
    """Pretraining: next-token cross-entropy over every position of fixed-length
    sequences from the phase's loader (``MixedLoader``, seeked to the index)."""

    name = "lm"

    def __init__(self, loader: MixedLoader | None):
        self.loader = loader

    def batch(self, index: int) -> Batch:
        assert self.loader is not None, "an objective built without a loader only makes batch_of"
        if self.loader.batches_served != index:
            self.loader.seek(index)
        return self.batch_of(self.loader.next_batch())

    @staticmethod
    def batch_of(input_ids: torch.Tensor) -> Batch:
        """An LM batch of given sequences. Every rank holds as many sequences of the
        same length, so the rank's own target count is its share of the global one."""
        b, n = input_ids.shape
        return Batch(
            {"input_ids": input_ids, "labels": shifted_labels(input_ids)},
            denominator=float(b * (n - 1)),
            tokens=b * n,
        )

    def model_inputs(self, part: Tensors) -> Tensors:
        return {"input_ids": part["input_ids"]}

    def loss_sum(self, logits: torch.Tensor, part: Tensors) -> torch.Tensor:
        return token_nll_sum(logits, part["labels"])
