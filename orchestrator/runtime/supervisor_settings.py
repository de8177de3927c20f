"""The supervisor's settings: its loop's intervals and bounds, where runs are placed,
and the operator's knobs every run's trainer gets (never the tenant's manifest)."""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.runtime.placement import PlacementSettings

# TrainStageConfig fields an operator may set for every run; a tenant's manifest
# never reaches them (it has no such section).
OPERATOR_TRAIN_OVERRIDES = frozenset(
    {
        "pace_step_s",
        "degraded_pace_step_s",
        "fault_tolerance",
        "worker_num_cpus",
        "inject_loss_spike",
    }
)


class SupervisorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    poll_interval_s: float = Field(default=0.5, gt=0)
    # One driver RPC (poll, ping) may take this long before the tick moves on.
    rpc_timeout_s: float = Field(default=10.0, gt=0)
    # After cancel, the driver gets this long to stop its stages cleanly; then
    # every actor of the run is killed. Well inside the 30 s promise.
    cancel_grace_s: float = Field(default=10.0, gt=0)
    # How often every active run's booking, account and term are re-checked; a run
    # whose authority lapsed is stopped then, so this plus cancel_grace_s bounds how
    # long work outlives its booking (well inside 30 s).
    authority_check_interval_s: float = Field(default=2.0, gt=0, le=30)
    # How often running runs' bookings are checked for added or removed nodes: with
    # one driver RPC, this bounds the wait from ``bookings add-nodes``/``remove-nodes``
    # to the run's driver holding the resize (a second of the resize's budget).
    resize_check_interval_s: float = Field(default=1.0, gt=0, le=30)
    max_driver_attempts: int = Field(default=2, ge=1)
    # The leader lease: a standby replica takes over this long after the leader's last
    # renewal (it renews every poll). Long enough that a busy tick (up to rpc_timeout_s
    # per driver call) or a store failover does not hand it over needlessly.
    supervisor_lease_s: float = Field(default=15.0, gt=0)
    # Operator-level TrainStageConfig overrides passed to every run (test pacing,
    # fault-tolerance timeouts), e.g. ITO_TRAIN_OVERRIDES='{"pace_step_s": 0.2}'.
    train_overrides: dict[str, Any] = Field(default_factory=dict)
    # Where runs go: their booking's nodes (ITO_PLACEMENT_WAIT_S sets the wait).
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    # Server-wide checkpoint roots (``serve --checkpoint-root``): every account's model
    # folders may lie in them, as at submit (orchestrator/gates/roots.py).
    checkpoint_roots: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _lease_outlasts_polls(self) -> SupervisorSettings:
        if self.supervisor_lease_s < 3 * self.poll_interval_s:
            raise ValueError(
                "supervisor_lease_s must be at least 3 poll intervals: the "
                "leader renews once a poll"
            )
        return self

    @field_validator("train_overrides")
    @classmethod
    def _known_overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = set(v) - OPERATOR_TRAIN_OVERRIDES
        if unknown:
            raise ValueError(
                f"not operator train overrides: {sorted(unknown)}; allowed: "
                f"{sorted(OPERATOR_TRAIN_OVERRIDES)}"
            )
        return v

    @classmethod
    def from_env(cls) -> SupervisorSettings:
        raw = os.environ.get("ITO_TRAIN_OVERRIDES")
        wait = os.environ.get("ITO_PLACEMENT_WAIT_S")
        lease = os.environ.get("ITO_SUPERVISOR_LEASE_S")
        kw: dict[str, Any] = {"train_overrides": json.loads(raw)} if raw else {}
        if wait:
            kw["placement"] = PlacementSettings(wait_timeout_s=float(wait))
        if lease:
            kw["supervisor_lease_s"] = float(lease)
        return cls(**kw)
