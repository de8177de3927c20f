"""Stage 2: the parallelism and precision planner.

``plan(request)`` picks degrees, micro-batch, recompute and precision for a booking;
``validate_layout(request, layout)`` checks hand-set degrees. Both raise ``ItoError``
with a ``plan_*`` code (or gpu_sku_unknown / fabric_unknown / model_preset_unknown).
"""

from stages.parallelism.config import ParallelismConfig
from stages.parallelism.hardware import (
    Fabric,
    GpuSku,
    list_fabrics,
    list_gpu_skus,
    load_fabric,
    load_gpu_sku,
)
from stages.parallelism.planner import validate_layout
from stages.parallelism.search import plan
from stages.parallelism.spec import (
    Layout,
    MemoryBreakdown,
    Plan,
    PlanRequest,
    Rejection,
    StepTimeBreakdown,
)
from stages.parallelism.stage import ParallelismStage, request_from

__all__ = [
    "Fabric",
    "GpuSku",
    "Layout",
    "MemoryBreakdown",
    "ParallelismConfig",
    "ParallelismStage",
    "Plan",
    "PlanRequest",
    "Rejection",
    "StepTimeBreakdown",
    "list_fabrics",
    "list_gpu_skus",
    "load_fabric",
    "load_gpu_sku",
    "plan",
    "request_from",
    "validate_layout",
]
