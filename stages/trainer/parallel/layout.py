"""The layout inside one torchft replica group, as the planner chose it, and the check
that this device can run it.

A replica group is ``pp x dp_shard x cp x tp`` ranks (torchtitan's mesh without
``dp_replicate``: torchft replicates across groups). This module imports no
torch.distributed, so validation can use it before any process group exists.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from typing_extensions import TypedDict  # pydantic reads it (a rank's report) on 3.11

from stages.base import StrictModel
from stages.errors import ErrorCode, ItoError
from stages.parallelism.hardware import FP8_TRAINING_MIN_CAPABILITY, SKU_COMPUTE_CAPABILITY

PipelineSchedule = Literal["1F1B", "Interleaved1F1B", "GPipe"]
ActivationCheckpointing = Literal["none", "selective", "full"]
TrainPrecision = Literal["fp32", "bf16", "fp8"]
# torchtitan's mesh order (outermost first); dp_replicate is torchft's, across groups.
MESH_DIMS: tuple[str, ...] = ("pp", "dp_shard", "cp", "tp")
FP8_MIN_CAPABILITY = FP8_TRAINING_MIN_CAPABILITY


class BuiltLayout(TypedDict):
    """The layout a rank built, read back from what it built
    (``ParallelModel.built_layout``), as the rank reports it."""

    pp: int
    dp_shard: int
    cp: int
    tp: int
    pp_schedule: str | None
    pp_microbatches: int
    pp_stage_layers: list[int]
    activation_checkpointing: str
    precision: str
    sequence_parallel: bool


class ParallelLayout(StrictModel):
    """Degrees and techniques of one replica group (the plan's, minus dp_replicate)."""

    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    dp_shard: int = Field(default=-1, ge=-1, description="-1: the group's remaining ranks")
    pp_schedule: PipelineSchedule = "1F1B"
    pp_virtual_stages: int = Field(default=1, ge=1)
    pp_microbatches: int = Field(default=0, ge=0, description="0: pp (or pp x virtual)")
    # Without PP: forward/backward passes per step (the plan's micro-batch x accum).
    grad_accum: int = Field(default=1, ge=1)
    # Decoder layers per pipeline rank (uneven allowed); empty: split evenly.
    pp_stage_layers: list[int] = Field(default_factory=list)
    activation_checkpointing: ActivationCheckpointing = "none"
    precision: TrainPrecision = "fp32"

    @model_validator(mode="after")
    def _check(self) -> ParallelLayout:
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be positive or -1 (infer)")
        if self.pp_virtual_stages > 1 and self.pp_schedule != "Interleaved1F1B":
            raise ValueError("pp_virtual_stages > 1 needs pp_schedule Interleaved1F1B")
        if self.pp_stage_layers and len(self.pp_stage_layers) != self.pp:
            raise ValueError("pp_stage_layers needs one entry per pipeline rank")
        if any(n < 1 for n in self.pp_stage_layers):
            raise ValueError("every pipeline rank needs at least one decoder layer")
        return self

    def resolved(self, ranks_per_group: int) -> ParallelLayout:
        """dp_shard inferred, microbatches defaulted; raises if the degrees do not
        multiply to the group's ranks."""
        rest = self.tp * self.pp * self.cp
        dp = self.dp_shard if self.dp_shard != -1 else ranks_per_group // rest
        if dp < 1 or rest * dp != ranks_per_group:
            raise ItoError(
                ErrorCode.plan_degrees_mismatch,
                f"tp {self.tp} x pp {self.pp} x cp {self.cp} x dp_shard "
                f"{self.dp_shard} != {ranks_per_group} ranks per replica group",
            )
        mbs = self.pp_microbatches or (self.pp * self.pp_virtual_stages if self.pp > 1 else 1)
        return self.model_copy(update={"dp_shard": dp, "pp_microbatches": mbs})

    def for_post_training(self) -> ParallelLayout:
        """The layout a post-training objective runs on a group of these ranks: the
        same tensor parallelism, the pipeline and context ranks folded into FSDP (the
        objectives run neither), fp32 without recompute, as the planner sizes them
        (``stages.parallelism.post_training``)."""
        return ParallelLayout(tp=self.tp, dp_shard=self.dp_shard * self.pp * self.cp)

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of a group rank on the (pp, dp_shard, cp, tp) mesh."""
        out: dict[str, int] = {}
        for name in reversed(MESH_DIMS):
            size = self.degrees()[name]
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline rank: the plan's split, else as even as can be
        (the remainder goes to the middle ranks; the ends hold embedding and head)."""
        if self.pp_stage_layers:
            if sum(self.pp_stage_layers) != num_layers:
                raise ItoError(
                    ErrorCode.plan_pp_layers_unbalanced,
                    f"pp_stage_layers {self.pp_stage_layers} do not sum to the "
                    f"model's {num_layers} layers",
                )
            return list(self.pp_stage_layers)
        chunks = self.pp * self.pp_virtual_stages
        if chunks > num_layers:
            raise ItoError(
                ErrorCode.plan_pp_layers_unbalanced,
                f"{num_layers} layers cannot fill {chunks} pipeline chunks",
            )
        base, extra = divmod(num_layers, self.pp)
        counts = [base] * self.pp
        order = [*range(1, self.pp - 1), 0, self.pp - 1][: self.pp]
        for i in range(extra):
            counts[order[i]] += 1
        return counts

    def chunk_layers(self, num_layers: int) -> list[tuple[int, int]]:
        """``[start, end)`` decoder layers of each model chunk, in pipeline order:
        chunk ``j`` runs on pipeline rank ``j % pp`` (the interleaved layout)."""
        per_rank = self.stage_layers(num_layers)
        v = self.pp_virtual_stages
        sizes = []
        for j in range(self.pp * v):
            r, local = j % self.pp, j // self.pp
            base, extra = divmod(per_rank[r], v)
            sizes.append(base + (1 if local < extra else 0))
        if min(sizes) < 1:
            raise ItoError(
                ErrorCode.plan_pp_layers_unbalanced,
                f"{num_layers} layers cannot fill {self.pp * v} pipeline chunks",
            )
        out, start = [], 0
        for n in sizes:
            out.append((start, start + n))
            start += n
        return out


def check_runnable_on_sku(layout: ParallelLayout, gpu_sku: str) -> None:
    """``check_runnable`` for a booking's SKU, before anything runs (validation)."""
    if gpu_sku.startswith("cpu"):
        check_runnable(layout, "cpu")
    else:
        check_runnable(layout, "cuda", SKU_COMPUTE_CAPABILITY.get(gpu_sku))


def check_runnable(
    layout: ParallelLayout, device: str, capability: tuple[int, int] | None = None
) -> None:
    """Refuse what this device cannot execute: context parallel and fp8 need CUDA
    (ring attention, torchao float8 kernels), fp8 needs SM 9.0 or newer.
    ``capability`` is the GPU's (major, minor); None where it is not known yet
    (validation before the workers start), in which case only the device is checked."""
    if device != "cuda":
        if layout.cp > 1:
            raise ItoError(
                ErrorCode.layout_unsupported,
                f"context parallel (cp {layout.cp}) needs CUDA: ring attention "
                f"has no CPU implementation in torch",
            )
        if layout.precision == "fp8":
            raise ItoError(
                ErrorCode.layout_unsupported,
                "fp8 training needs an H100-class GPU (torchao float8)",
            )
        return
    if layout.precision == "fp8" and capability is not None and capability < FP8_MIN_CAPABILITY:
        raise ItoError(
            ErrorCode.layout_unsupported,
            f"fp8 training needs SM {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}"
            f" (H100-class); this GPU is SM {capability[0]}.{capability[1]}",
        )


def layout_from_plan(plan: dict[str, object]) -> ParallelLayout:
    """The trainer's part of a planner ``Plan`` (as stored in the stage's artifacts)."""

    def num(key: str, default: int = 1) -> int:
        v = plan.get(key, default)
        return int(v) if isinstance(v, (int, float, str)) else default

    layers = plan.get("pp_stage_layers") or []
    pp = num("pp")
    return ParallelLayout(
        tp=num("tp"),
        pp=pp,
        cp=num("cp"),
        dp_shard=num("dp_shard"),
        pp_schedule=str(plan.get("pp_schedule", "1F1B")),  # type: ignore[arg-type]
        pp_virtual_stages=num("pp_virtual_stages"),
        pp_microbatches=num("pp_microbatches", 0) if pp > 1 else 0,
        grad_accum=num("grad_accum") if pp == 1 else 1,
        pp_stage_layers=[int(x) for x in layers] if pp > 1 and isinstance(layers, list) else [],
        activation_checkpointing=str(  # type: ignore[arg-type]
            plan.get("activation_checkpointing", "none")
        ),
        precision=str(plan.get("precision", "fp32")),  # type: ignore[arg-type]
    )
