"""The training engine: torchft live recovery on Ray, one loop for every phase.

Light on purpose: importing ``stages.trainer`` pulls in neither Ray nor torchft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stages.trainer.config import (
    FaultToleranceConfig,
    LossSpikeConfig,
    LossSpikeInjection,
    ModelSpec,
    TrainingTarget,
    TrainStageConfig,
)

if TYPE_CHECKING:
    from stages.trainer.fleet.engine import TrainingEngine
    from stages.trainer.fleet.kill import (
        kill_replica_group,
        kill_replica_groups,
        replica_group_pids,
    )
    from stages.trainer.stage import TrainingStage

__all__ = [
    "FaultToleranceConfig",
    "LossSpikeConfig",
    "LossSpikeInjection",
    "ModelSpec",
    "TrainStageConfig",
    "TrainingEngine",
    "TrainingStage",
    "TrainingTarget",
    "kill_replica_group",
    "kill_replica_groups",
    "replica_group_pids",
]


def __getattr__(name: str) -> Any:
    if name == "TrainingStage":
        from stages.trainer.stage import TrainingStage

        return TrainingStage
    if name == "TrainingEngine":
        from stages.trainer.fleet.engine import TrainingEngine

        return TrainingEngine
    if name in ("kill_replica_group", "kill_replica_groups", "replica_group_pids"):
        from stages.trainer.fleet import kill

        return getattr(kill, name)
    raise AttributeError(name)
