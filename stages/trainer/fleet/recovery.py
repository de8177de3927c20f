"""How a run recovers from a lost rank, decided in one place.

``production_recovery`` is the fault-tolerance configuration a booking's runs get:
the pipeline launches it and ``benchmarks/fault_tolerance.py`` measures it, so the
published recovery figures are those of the path production takes.

``failure_time`` is when a lost worker process died, as Ray recorded it: the GCS
worker table's end time of that pid (kept for dead workers, restarted actors
included). It is the start of an interruption's ``detect_s`` and ``recover_s``,
and ``failure_times`` is how the engine finds dead ranks the moment a survivor's
collective fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from pydantic import Field

from stages.base import StrictModel
from stages.trainer.config import FaultToleranceConfig

# Warm standby groups each node of a booking keeps ready (imports done, model built,
# one warm-up step run; a standby group has as many ranks as a replica group): a lost
# group's place is taken at once instead of waiting for Ray to start, import and
# build new processes.
STANDBYS_PER_NODE = 1


class RecoveryFields(TypedDict):
    """The ``TrainStageConfig`` fields a ``RecoveryConfig`` decides."""

    spare_groups: int
    fault_tolerance: FaultToleranceConfig


class RecoveryConfig(StrictModel):
    """The fault-tolerance part of a training stage's config."""

    standbys_per_node: int = Field(ge=0, le=8)
    nodes: int = Field(ge=1)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)

    @property
    def spare_groups(self) -> int:
        return self.standbys_per_node * self.nodes

    def train_fields(self) -> RecoveryFields:
        """The ``TrainStageConfig`` fields this decides, typed."""
        return {"spare_groups": self.spare_groups, "fault_tolerance": self.fault_tolerance}


def production_recovery(
    booking: Mapping[str, Any], *, standbys_per_node: int = STANDBYS_PER_NODE
) -> RecoveryConfig:
    """The recovery configuration of a run on ``booking`` (its ``node_count``).

    A multi-rank group is one failure unit: when one of its ranks dies, a standby
    group (as many ranks as the replica group) takes the whole group's place, or,
    with none warm, Ray restarts the group's ranks."""
    nodes = max(1, int(booking.get("node_count") or 1))
    return RecoveryConfig(standbys_per_node=standbys_per_node, nodes=nodes)


def failure_times(pids: list[int]) -> dict[int, float]:
    """Unix end time of each of ``pids`` that Ray's GCS records as a dead worker."""
    if not pids:
        return {}
    try:
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        accessor = state._connect_and_get_accessor()
        wanted = set(pids)
        ends: dict[int, float] = {}
        for raw in accessor.get_worker_table():
            row = gcs_pb2.WorkerTableData.FromString(raw)  # type: ignore[attr-defined]
            if row.pid in wanted and not row.is_alive and row.end_time_ms:
                ends[row.pid] = max(ends.get(row.pid, 0.0), row.end_time_ms / 1000.0)
        return ends
    except Exception:  # a private Ray API: never let a lookup fail the run
        return {}


def failure_time(pid: int | None) -> float | None:
    """Unix time at which worker process ``pid`` ended, as Ray's GCS recorded it;
    None when Ray has no record of its end (yet)."""
    return None if pid is None else failure_times([pid]).get(pid)
