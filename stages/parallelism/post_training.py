"""Per-GPU peak memory of an SFT, DPO or RLVR objective, planned like a curriculum phase.

A post-training objective trains on the engine as its ``TrainStageConfig``
(``stages.post_training.on_engine``) sets it up: the run's replica groups and their
ranks, tensor parallel as the run's plan and FSDP over the group's other ranks (the
plan's pipeline and context ranks folded in:
``stages.trainer.parallel.layout.ParallelLayout.for_post_training``), the policy in
fp32, AdamW, no recompute, the recipe's ``batch_size`` rows (sft) or pairs (dpo)
split over every data-parallel rank and trained in one forward at up to
``max_length`` tokens. The model is ``stages.parallelism.memory``'s, with:

- policy: fp32 weights, fp32 gradients and AdamW's two fp32 moments;
- activations at ``max_length`` for every sequence of a rank's share of the batch; a
  DPO pair is two sequences (chosen and rejected in one forward);
- the DPO reference: none resident. Its log-probs are precomputed once at the rank's
  start-up from the freshly loaded base weights, like trl's
  ``precompute_ref_log_probs`` (two floats a pair, kept on the host), so no second
  model lives beside the policy while it trains;
- an RLVR (GRPO) learner step: ``groups_per_step x group_size`` sequences of up to
  ``max_prompt_tokens + max_completion_tokens`` tokens split over the groups (the
  behaviour log-probs come with the rollouts: no extra forward model); with a KL term
  (``beta > 0``) a frozen fp32 copy of the base is resident beside the policy
  (``stages.post_training.grpo_objective``), at every moment of the objective;
- the objective's end (``stages.evals.objective_eval``): while the policy and AdamW's
  state are still resident, the evaluating rank loads the base folder in fp32 to
  score the objective's "before" numbers and runs forwards of one sequence; that is a
  second moment, and the peak is the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.errors import ErrorCode, ItoError
from stages.parallelism.memory import (
    GIB,
    LOSS_BYTES_PER_LOGIT,
    MASTER_BYTES,
    MemoryEstimate,
    estimate_memory,
)
from stages.presets import ModelPreset

ObjectiveKind = Literal["sft", "dpo", "rlvr"]


@dataclass(frozen=True)
class ObjectiveMemory:
    training: MemoryEstimate  # the peak of a training step
    scoring: float  # bytes at the objective's end: resident state, the base copy, a forward
    reference: float = 0.0  # a frozen reference resident for the whole objective (RLVR's KL)

    @property
    def peak(self) -> float:
        return max(self.training.total, self.scoring) + self.reference


def sequences_per_rank(kind: ObjectiveKind, batch_size: int, dp_ranks: int) -> int:
    """Sequences one rank forwards per step, the batch split over the run's
    ``dp_ranks`` data-parallel ranks (a DPO pair is two; an RLVR step's ``batch_size``
    counts sequences: groups x group size)."""
    rows = -(-batch_size // dp_ranks)
    return rows * (2 if kind == "dpo" else 1)


def objective_memory(
    preset: ModelPreset,
    *,
    kind: ObjectiveKind,
    batch_size: int,
    max_length: int,
    replica_groups: int,
    tp: int = 1,
    fsdp: int = 1,
    foreach_optimizer: bool = True,
    resident_reference: bool = False,
) -> ObjectiveMemory:
    training = estimate_memory(
        preset,
        seq_len=max_length,
        micro_batch=sequences_per_rank(kind, batch_size, replica_groups * fsdp),
        microbatches=1,
        tp=tp,
        cp=1,
        fsdp=fsdp,
        dp_replicate=replica_groups,
        pp_stage_layers=[preset.num_hidden_layers],
        pp_schedule="1F1B",
        pp_virtual_stages=1,
        activation_checkpointing="none",
        precision="fp32",
        foreach_optimizer=foreach_optimizer,
        # SFT's, DPO's and GRPO's losses take gathered logits (ParallelModel): under
        # TP every rank runs them over the whole vocabulary
        loss_parallel=False,
    )
    params = preset.num_params
    forward = LOSS_BYTES_PER_LOGIT * max_length * preset.vocab_size
    scoring = training.weights + training.optimizer + params * MASTER_BYTES + forward
    return ObjectiveMemory(training, scoring, params * MASTER_BYTES if resident_reference else 0.0)


def check_objective_memory(
    preset: ModelPreset,
    *,
    objective: ObjectiveKind,
    batch_size: int,
    max_length: int,
    replica_groups: int,
    device_memory_gib: float,
    memory_utilization: float,
    tp: int = 1,
    fsdp: int = 1,
    foreach_optimizer: bool = True,
    resident_reference: bool = False,
) -> ObjectiveMemory:
    """The objective's memory, or ``plan_out_of_memory`` naming it and its parts;
    ``plan_objective_unsupported`` when its batch does not split over the run's
    data-parallel ranks (replica groups x ``fsdp``)."""
    dp_ranks = replica_groups * fsdp
    if batch_size % dp_ranks:
        raise ItoError(
            ErrorCode.plan_objective_unsupported,
            f"post_training.{objective}: a batch of {batch_size} does not split over the "
            f"run's {dp_ranks} data-parallel ranks ({replica_groups} replica groups x "
            f"{fsdp} FSDP ranks); use a multiple of {dp_ranks}",
            details={"objective": objective, "dp_ranks": dp_ranks},
        )
    mem = objective_memory(
        preset,
        kind=objective,
        batch_size=batch_size,
        max_length=max_length,
        replica_groups=replica_groups,
        tp=tp,
        fsdp=fsdp,
        foreach_optimizer=foreach_optimizer,
        resident_reference=resident_reference,
    )
    capacity = device_memory_gib * memory_utilization
    peak = mem.peak / GIB
    if peak > capacity:
        t = mem.training
        raise ItoError(
            ErrorCode.plan_out_of_memory,
            f"post_training.{objective}: predicted peak {peak:.1f} GiB per GPU exceeds the "
            f"usable {capacity:.1f} GiB (policy weights {t.weights / GIB:.1f}, gradients "
            f"{t.gradients / GIB:.1f}, optimizer {t.optimizer / GIB:.1f}, activations at "
            f"max_length {max_length} {t.activations / GIB:.1f}, objective-end scoring "
            f"{mem.scoring / GIB:.1f}, resident reference {mem.reference / GIB:.1f}; "
            "the DPO reference is precomputed log-probs); lower the batch (rlvr: "
            "groups_per_step x group_size) or the sequence length (rlvr: "
            "max_prompt_tokens + max_completion_tokens), or book more GPUs (an objective "
            "shards over every rank of the run's replica groups)",
            details={"peak_memory_gib": round(peak, 2), "objective": objective},
        )
    return mem
