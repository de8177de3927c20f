"""GPU SKUs (``configs/gpus/<SKU>.json``) and fabrics (``configs/fabrics/<name>.json``).

The file name is the name a booking uses. Field names are read by the API server
too (``memory_gib``, ``bf16_tflops``): never rename them, only add optional ones.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.errors import ErrorCode, ItoError
from stages.presets import list_configs, load_config

Precision = Literal["fp32", "bf16", "fp8"]
# CUDA compute capability of the SKUs in configs/gpus. fp8 training (torchao float8,
# what the trainer runs) needs H100-class tensor cores, SM 9.0: SM 8.9 parts (L40S)
# have fp8 TFLOP/s but are not fp8 training targets here.
SKU_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "A100-80G": (8, 0),
    "L40S": (8, 9),
    "H100-SXM": (9, 0),
    "H100-PCIe": (9, 0),
    "H200": (9, 0),
    "B200": (10, 0),
}
FP8_TRAINING_MIN_CAPABILITY = (9, 0)


class GpuSku(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str = ""
    memory_gib: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0, description="dense bf16 peak, the MFU denominator")
    fp8_tflops: float | None = Field(default=None, gt=0, description="dense fp8 peak; null: no fp8")
    hbm_bandwidth_gb_s: float = Field(gt=0)
    intra_node_link: Literal["nvlink", "pcie", "loopback"]
    nvlink_domain: int = Field(ge=1, description="GPUs that share one NVLink domain")
    intra_node_bandwidth_gb_s: float = Field(gt=0, description="per GPU, one direction")
    mfu_floor: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="plans predicted under this MFU are refused as wasteful",
    )
    # Precisions this device trains in; ``auto`` takes the first (fp8 is tried on top
    # when the SKU has fp8 TFLOP/s). Empty means bf16 (+ fp8 when fp8_tflops is set).
    precisions: tuple[Precision, ...] = ()
    # Other spellings of this SKU (as upstream or vendors write it); see canonical_name.
    aliases: tuple[str, ...] = ()

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_tflops is not None

    @property
    def trains_fp8(self) -> bool:
        """fp8 tensor cores the trainer can train on (SM 9.0 or newer)."""
        cap = SKU_COMPUTE_CAPABILITY.get(self.name)
        return self.supports_fp8 and (cap is None or cap >= FP8_TRAINING_MIN_CAPABILITY)

    def peak_tflops(self, precision: Precision) -> float:
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise ItoError(
                    ErrorCode.plan_fp8_unsupported, f"{self.name} has no fp8 tensor cores"
                )
            return self.fp8_tflops
        if precision == "fp32" and self.intra_node_link != "loopback":
            return self.bf16_tflops / 2  # TF32 tensor cores run at half the bf16 rate
        return self.bf16_tflops

    @property
    def default_precision(self) -> Precision:
        return self.precisions[0] if self.precisions else "bf16"


class Fabric(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str = ""
    inter_node_bandwidth_gb_s_per_gpu: float = Field(gt=0, description="one direction")
    latency_us: float = Field(ge=0)
    efficiency: float = Field(default=0.8, gt=0, le=1, description="achievable share of line rate")
    aliases: tuple[str, ...] = ()


def list_gpu_skus() -> list[str]:
    return list_configs("gpus")


def list_fabrics() -> list[str]:
    return list_configs("fabrics")


@cache
def load_gpu_sku(name: str) -> GpuSku:
    return load_config("gpus", name, GpuSku, ErrorCode.gpu_sku_unknown)


def resolve_gpu_sku(sku: str | GpuSku) -> GpuSku:
    """A request's SKU: a configs/gpus name, or a SKU given whole (``measured_sku``)."""
    return sku if isinstance(sku, GpuSku) else load_gpu_sku(sku)


def measured_sku(sku: GpuSku, predicted_step_s: float, measured_step_s: float) -> GpuSku:
    """``sku`` as a device measured it: a step of the model alone on one device (forward,
    backward and optimizer, no communication) that the planner predicts at
    ``predicted_step_s`` took ``measured_step_s``. The planner's compute time is the
    larger of a GEMM's FLOPs over the peak and its bytes over the memory bandwidth, and
    the optimizer's bytes over the bandwidth, so scaling both rates by predicted /
    measured makes the prediction of that step the measured one; the links are left as
    they are, and so is the name (what the SKU is, e.g. whether it trains fp8). This is
    the fabric's counterpart of a link a benchmark measured: a host
    whose cores are shared or throttled computes at its own rate, not a catalogue's."""
    if predicted_step_s <= 0 or measured_step_s <= 0:
        raise ValueError("predicted and measured step times must be positive")
    scale = predicted_step_s / measured_step_s
    fp8 = None if sku.fp8_tflops is None else sku.fp8_tflops * scale
    return sku.model_copy(
        update={
            "description": f"{sku.name} at {scale:.3g}x its rates, as a device measured",
            "bf16_tflops": sku.bf16_tflops * scale,
            "fp8_tflops": fp8,
            "hbm_bandwidth_gb_s": sku.hbm_bandwidth_gb_s * scale,
        }
    )


@cache
def load_fabric(name: str) -> Fabric:
    return load_config("fabrics", name, Fabric, ErrorCode.fabric_unknown)


def _spelling(name: str) -> str:
    """Case, spaces and punctuation do not tell two names apart."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def canonical_name(kind: Literal["gpus", "fabrics"], name: str) -> str:
    """The config name (``configs/<kind>/<name>.json``) a SKU or fabric spelling means:
    the name itself or one of the profile's ``aliases``, ignoring case, spaces and
    punctuation (``InfiniBand NDR``, ``infiniband-ndr`` -> ``ib-ndr``). An unknown
    spelling is ``gpu_sku_unknown`` / ``fabric_unknown``."""
    load = load_gpu_sku if kind == "gpus" else load_fabric
    table: dict[str, str] = {}
    for known in list_configs(kind):
        for spelling in (known, *load(known).aliases):
            table.setdefault(_spelling(spelling), known)
    hit = table.get(_spelling(name))
    if hit is None:
        code = ErrorCode.gpu_sku_unknown if kind == "gpus" else ErrorCode.fabric_unknown
        what = "GPU SKU" if kind == "gpus" else "fabric"
        raise ItoError(
            code,
            f"unknown {what} {name[:64]!r}; known: "
            f"{', '.join(list_configs(kind))} (or an alias in their profiles)",
        )
    return hit
