"""What the orchestrator resolved for a run and hands its stages: one typed record.

The supervisor builds a :class:`RunFacts` when it launches a run's driver (the
booking's topology, the account's input roots, the run's reservation, the
operator's trainer knobs); it travels inside the signed ``LaunchSpec`` and is
validated once there, and the driver's ``StageContext.facts`` is that record with
the signed account. Stages read a fact by its field (``ctx.facts.placement``).
Stages never import the orchestrator, so the record lives here.

On the wire (``LaunchSpec.model_dump()``) the record is a dict keyed by the field
names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class PlacementFact(BaseModel):
    """What a stage learns about its run's reservation (no secret, JSON-safe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    booking_id: str
    # The node mark the bundles reserve: ``booking:<id>`` (or the embedded head's
    # catch-all mark, see docs/placement.md).
    resource: str
    placement_group: str  # the group's name, run-<id>-pg
    placement_group_id: str  # hex, to rebuild the handle without a name lookup
    bundles: int = Field(ge=1)
    # Resources of one bundle, e.g. {"booking:bk1": 8, "CPU": 96, "GPU": 8}.
    bundle: dict[str, float] = Field(default_factory=dict)

    @property
    def device(self) -> Literal["cpu", "cuda"]:
        """The run's device: cuda where its bundles reserve the nodes' GPUs (the
        placement reserves them only where every booked node has them), else cpu (the
        testbed, the embedded head)."""
        return "cuda" if self.bundle.get("GPU", 0) > 0 else "cpu"


class BookingTopology(BaseModel):
    """The booking's topology the planner and the trainer's recovery size for. A
    booking row's other columns (its id, account, times) are not topology: ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    gpu_sku: str | None = None
    gpus_per_node: int | None = None
    node_count: int | None = None
    region: str | None = None
    # A fabric profile's name (stages.parallelism's fabrics).
    fabric: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields the booking gave (a missing one stays missing: the planner
        refuses an incomplete topology by name)."""
        return self.model_dump(exclude_unset=True)


class RunFacts(BaseModel):
    """Run-scoped facts the orchestrator resolved, one field per fact."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # The booking's topology: what the planner lays the run out on.
    booking: BookingTopology = Field(default_factory=BookingTopology)
    # The run's reservation of the booking's nodes; None: a stage run alone (a unit
    # test, a benchmark), whose actors Ray schedules as it likes.
    placement: PlacementFact | None = None
    # The account the run belongs to (the signed launch spec's): checkpoints are
    # sealed for it.
    account: str = ""
    # The account's roots, from the store (never from the manifest): the stages
    # resolve data references in ``data_roots`` and model folders in ``model_roots``
    # again at run time.
    data_roots: tuple[str, ...] = ()
    model_roots: tuple[str, ...] = ()
    # The trainer's and the rollout workers' device: the placement's (``PlacementFact.device``).
    device: Literal["cpu", "cuda"] = "cpu"
    # Operator-level trainer knobs (never from the tenant's manifest): fields of
    # ``TrainStageConfig``, a closed set the supervisor's settings check, validated
    # again by that config.
    train_overrides: dict[str, Any] = Field(default_factory=dict)
