"""Typed config of the parallelism stage (the manifest may embed it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.base import StrictModel
from stages.parallelism.spec import ActivationCheckpointing, PrecisionPreference
from stages.replica_sync import ReplicaSync


class ParallelismConfig(StrictModel):
    """Model and batch to plan for; the topology comes from the booking."""

    model: str = Field(description="configs/models preset name, e.g. llama3-8b")
    global_batch_tokens: int = Field(gt=0, le=1 << 30)
    seq_len: int | None = Field(default=None, gt=1)
    precision: PrecisionPreference = "auto"
    activation_checkpointing: ActivationCheckpointing | Literal["auto"] = "auto"
    mfu_floor: float | None = Field(
        default=None, ge=0, lt=1, description="None: the GPU SKU's floor"
    )
    max_pp_bubble: float = Field(default=0.25, gt=0, lt=1)
    min_replica_groups: int = Field(
        default=1, ge=1, description="torchft replica groups the plan must have"
    )
    # The manifest's pinned sync (None: the planner chooses from the fabric) and the
    # step counts a DiLoCo H must divide (checkpoint interval, phase ends).
    sync: ReplicaSync | None = None
    sync_divides: list[int] = Field(default_factory=list, max_length=1024)
    # GPUs on each of the booking's nodes that RLVR's rollout workers hold: the trainer
    # is planned on the rest (``orchestrator.gates.planning.rollout_gpus_per_node``).
    rollout_gpus_per_node: int = Field(default=0, ge=0, le=1024)
