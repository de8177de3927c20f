"""Typed inputs and outputs of the planner: ``PlanRequest`` -> ``Plan``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.base import StrictModel
from stages.parallelism.hardware import Fabric, GpuSku, Precision
from stages.presets import ModelPreset, load_model_preset
from stages.replica_sync import ReplicaSync

ActivationCheckpointing = Literal["none", "selective", "full"]
PipelineSchedule = Literal["1F1B", "Interleaved1F1B", "GPipe"]
PrecisionPreference = Literal["auto", "fp32", "bf16", "fp8"]


class PlanRequest(StrictModel):
    """What to plan: a model, a global batch and the booking's metal."""

    model: str | ModelPreset = Field(description="a configs/models preset name, or a preset")
    gpu_sku: str | GpuSku = Field(
        description="a configs/gpus name, or a SKU (e.g. a device a benchmark measured)"
    )
    gpus_per_node: int = Field(gt=0, description="GPUs a node gives the trainer")
    node_count: int = Field(gt=0)
    # GPUs a node holds beyond ``gpus_per_node`` for RLVR's rollout workers (their own
    # devices): recorded on the plan, so a resize keeps them out of the trainer too.
    rollout_gpus_per_node: int = Field(default=0, ge=0)
    fabric: str | Fabric = Field(
        description="a configs/fabrics name, or a fabric (e.g. a link a benchmark measured)"
    )
    global_batch_tokens: int = Field(gt=0)
    seq_len: int | None = Field(
        default=None, gt=1, description="None: the preset's context, capped at 8192"
    )
    precision: PrecisionPreference = "auto"
    activation_checkpointing: ActivationCheckpointing | Literal["auto"] = "auto"
    # Bounds of the refusals; None takes the SKU's / planner's default.
    mfu_floor: float | None = Field(default=None, ge=0, lt=1)
    max_pp_bubble: float = Field(
        default=0.25, gt=0, lt=1, description="largest pipeline bubble, as a share of the step"
    )
    max_pp_imbalance: float = Field(
        default=0.25, ge=0, description="largest (slowest stage / mean stage) - 1"
    )
    memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="share of device memory a plan may use; the "
        "rest is CUDA context, NCCL and allocator fragmentation",
    )
    fp8_min_speedup: float = Field(
        default=1.1, ge=1, description="auto precision takes fp8 only if this much faster"
    )
    max_alternatives: int = Field(default=10, ge=0, le=100)
    # torchft heals a failed replica group live while the others train on, so more
    # groups buy fault tolerance: take the layout with the most replica groups among
    # those within this share of the fastest, and never fewer than the minimum.
    replica_preference_margin: float = Field(default=0.02, ge=0, lt=1)
    min_replica_groups: int = Field(default=1, ge=1)
    # How replica groups sync (stages.parallelism.sync). None: the planner chooses from
    # the fabric; a ReplicaSync: the manifest's pin, honoured and explained.
    sync: ReplicaSync | None = None
    # Step counts a DiLoCo H must divide: the checkpoint interval and every phase's end
    # step (groups' weights agree only at a sync). Empty: H is free.
    sync_divides: list[int] = Field(default_factory=list, max_length=1024)
    # Every step's replicate allreduce is not hidden under compute: past this share of
    # the step a layout's groups would mostly wait on the fabric, so DiLoCo is planned.
    max_sync_share: float = Field(default=0.3, gt=0, lt=1)
    # DiLoCo's H is the smallest whose sync, amortised over H inner steps, costs at most
    # this share of the inner step: a larger H only adds loss (staler groups).
    diloco_sync_share: float = Field(default=0.1, gt=0, lt=1)
    # The largest H planned: the DiLoCo paper trained well up to H = 500 and found
    # its loss degrading beyond; streaming DiLoCo used 100.
    max_sync_every: int = Field(default=500, ge=2, le=100_000)
    # The fewest syncs a DiLoCo run plans (its last step, the largest of sync_divides,
    # over H): with fewer the groups train apart for most of the run and meet once or
    # twice, which is averaging models, not training one. A 60-step run syncing 3 times
    # (H = 20) ended +2.4% held-out loss against every-step sync.
    min_diloco_syncs: int = Field(default=3, ge=1, le=1_000_000)
    # DiLoCo's outer Nesterov momentum pays off over many syncs (the paper's runs had
    # hundreds). Over a few it overshoots: a 60-step run syncing 3 times ended +3.3%
    # held-out loss with it (+5.3% with 6 syncs), +2.4% with plain averaging of the
    # groups' weights (outer lr 1, no momentum: torchft's LocalSGD), so a run with fewer
    # syncs than this averages. Its syncs: its last step (the largest of sync_divides)
    # over H; unknown (no sync_divides): momentum.
    nesterov_min_syncs: int = Field(default=50, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _sync_divides_positive(self) -> PlanRequest:
        if any(n < 1 for n in self.sync_divides):
            raise ValueError("sync_divides holds step counts (>= 1)")
        return self

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.node_count

    def preset(self) -> ModelPreset:
        return self.model if isinstance(self.model, ModelPreset) else load_model_preset(self.model)

    def resolved_seq_len(self) -> int:
        return self.seq_len or min(self.preset().max_position_embeddings, 8192)


class Layout(StrictModel):
    """Hand-set degrees, as a torchtitan user writes them. ``dp_shard=-1`` infers it."""

    tp: int = Field(default=1, gt=0)
    pp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    dp_shard: int = Field(default=-1, ge=-1)
    dp_replicate: int = Field(default=1, gt=0)
    micro_batch: int = Field(default=1, gt=0, description="sequences per GPU per micro-batch")
    pp_schedule: PipelineSchedule = "1F1B"
    pp_virtual_stages: int = Field(default=1, gt=0, description="model chunks per PP rank")
    activation_checkpointing: ActivationCheckpointing = "none"
    precision: Precision = "bf16"

    @model_validator(mode="after")
    def _check(self) -> Layout:
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be positive or -1 (infer)")
        if self.pp_virtual_stages > 1 and self.pp_schedule != "Interleaved1F1B":
            raise ValueError("pp_virtual_stages > 1 needs pp_schedule Interleaved1F1B")
        return self

    def label(self) -> str:
        sched = (
            ""
            if self.pp == 1
            else f" {self.pp_schedule}"
            + (f"x{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else "")
        )
        return (
            f"tp{self.tp} pp{self.pp}{sched} cp{self.cp} fsdp{self.dp_shard} "
            f"rep{self.dp_replicate} mb{self.micro_batch} ac={self.activation_checkpointing} "
            f"{self.precision}"
        )


class MemoryBreakdown(BaseModel):
    """Per-GPU peak memory of the busiest pipeline stage, GiB."""

    model_config = ConfigDict(extra="forbid")
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    total: float
    capacity: float = Field(description="usable GiB: memory_gib x memory_utilization")


class StepTimeBreakdown(BaseModel):
    """Predicted seconds of one optimizer step on the slowest rank."""

    model_config = ConfigDict(extra="forbid")
    compute: float
    pp_bubble: float
    tp_comm: float
    cp_comm: float
    fsdp_comm: float
    replicate_comm: float = Field(description="per step; 0 under DiLoCo (see outer_sync)")
    pp_comm: float
    optimizer: float
    outer_sync: float = Field(
        default=0.0,
        description="DiLoCo: the pseudo-gradient allreduce and outer step, amortised per step",
    )
    total: float


class Rejection(BaseModel):
    """One alternative the planner did not pick, ranked best first."""

    model_config = ConfigDict(extra="forbid")
    rank: int
    layout: str = Field(description="short label, e.g. 'tp8 pp2 1F1B cp1 fsdp4 ...'")
    degrees: Layout = Field(description="the layout itself: validate_layout() re-checks it")
    code: str | None = Field(description="refusal code, or None if feasible but slower")
    reason: str
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    gpu_sku: str
    fabric: str
    gpus_per_node: int  # the trainer's, on each node
    node_count: int
    # Each node's GPUs the rollout workers hold apart from the trainer (0: none).
    rollout_gpus_per_node: int = 0
    world_size: int
    global_batch_tokens: int
    seq_len: int
    tp: int
    pp: int
    pp_schedule: PipelineSchedule
    pp_virtual_stages: int
    pp_microbatches: int
    pp_stage_layers: list[int] = Field(description="decoder layers per pipeline rank")
    cp: int
    dp_shard: int
    dp_replicate: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: ActivationCheckpointing
    precision: Precision
    peak_memory_gib: float
    memory: MemoryBreakdown
    step_time_s: float = Field(description="mean seconds per step of the chosen sync")
    step_time: StepTimeBreakdown
    # How the replica groups sync (every step, or DiLoCo every sync.sync_every steps),
    # and the mean step time each mode predicts for this layout ("diloco" absent with
    # one replica group or no allowed H), so a run's measured step sits beside both.
    sync: ReplicaSync = Field(default_factory=ReplicaSync)
    step_time_by_sync: dict[str, float] = Field(default_factory=dict)
    tokens_per_s: float
    mfu: float
    reasons: list[str]
    rejected: list[Rejection] = Field(default_factory=list)

    def layout(self) -> Layout:
        return Layout(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            dp_shard=self.dp_shard,
            dp_replicate=self.dp_replicate,
            micro_batch=self.micro_batch,
            pp_schedule=self.pp_schedule,
            pp_virtual_stages=self.pp_virtual_stages,
            activation_checkpointing=self.activation_checkpointing,
            precision=self.precision,
        )
