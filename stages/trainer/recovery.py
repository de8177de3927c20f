"""How a run recovers from a lost rank, decided in one place.

``production_recovery`` is the fault-tolerance configuration a booking's runs get:
the pipeline launches it and ``benchmarks/fault_tolerance.py`` measures it, so the
published recovery figures are those of the path production takes.

``failure_time`` is when a lost worker process died, as Ray recorded it: the worker
table's end time of that pid (kept for dead workers, restarted actors included), or
the actor table's end time of a dead actor. It is the start of an interruption's
``detect_s`` and ``recover_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stages.base import StrictModel
from stages.trainer.config import FaultToleranceConfig

# Warm standby processes each node of a booking keeps ready (imports done, model
# built, optimizer constructed, one warm-up step run): a lost rank's place is taken
# at once instead of waiting for Ray to start, import and build a new process.
STANDBYS_PER_NODE = 1


class RecoveryConfig(StrictModel):
    """The fault-tolerance part of a training stage's config."""

    standbys_per_node: int = Field(ge=0, le=8)
    nodes: int = Field(ge=1)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)

    @property
    def spare_groups(self) -> int:
        return self.standbys_per_node * self.nodes

    def train_fields(self) -> dict[str, Any]:
        """The ``TrainStageConfig`` fields this decides."""
        return {"spare_groups": self.spare_groups,
                "fault_tolerance": self.fault_tolerance.model_dump(mode="json")}


def production_recovery(booking: Mapping[str, Any], *, ranks_per_group: int = 1,
                        standbys_per_node: int = STANDBYS_PER_NODE) -> RecoveryConfig:
    """The recovery configuration of a run on ``booking`` (its ``node_count``) whose
    replica groups have ``ranks_per_group`` ranks.

    A standby replaces a single-rank group only: a multi-rank group's lost rank is
    restarted by Ray with the rest of its group, so no standby is kept for it."""
    nodes = max(1, int(booking.get("node_count") or 1))
    return RecoveryConfig(standbys_per_node=standbys_per_node if ranks_per_group == 1 else 0,
                          nodes=nodes)


def failure_time(pid: int | None, actor_id: str | None = None) -> float | None:
    """Unix time at which worker process ``pid`` (or dead actor ``actor_id``) ended,
    as Ray's GCS recorded it; None when Ray has no record of the end (yet)."""
    if pid is None and actor_id is None:
        return None
    try:
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        if pid is not None:
            accessor = state._connect_and_get_accessor()
            ends = [row.end_time_ms for row in
                    (gcs_pb2.WorkerTableData.FromString(raw)  # type: ignore[attr-defined]
                     for raw in accessor.get_worker_table())
                    if row.pid == pid and not row.is_alive
                    and row.end_time_ms]
            if ends:
                return max(ends) / 1000.0
        if actor_id is not None:
            info = state.actor_table(actor_id)
            if info and info.get("State") == "DEAD" and info.get("EndTime"):
                return float(info["EndTime"]) / 1000.0
    except Exception:  # a private Ray API: never let a lookup fail the run
        return None
    return None
