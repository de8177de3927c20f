"""Reserving a booking's nodes for a run: one placement group per run.

Nodes join the cluster marked ``booking:<id>`` (amount: the node's GPUs). For each
accepted run the supervisor creates a detached placement group ``run-<id>-pg`` with
one bundle per booked node::

    {"booking:<id>": gpus_per_node, "CPU": <the node's CPUs>, "GPU": gpus_per_node}

(``GPU`` only when the booking's nodes report GPUs), strategy ``STRICT_SPREAD`` so
each bundle is a different node. Ray creates the group all at once or not at all:
that is the gang. Until it exists the run waits in ``starting`` with a reason
(no node joined, k of n joined, nodes busy with another run of the booking); after
``wait_timeout_s`` it fails with ``booking_nodes_unavailable`` or
``placement_timeout``. The group is removed when the run ends.

Nodes a booking gains while its run trains get a group of their own,
``run-<id>-pg-c<change>`` (one bundle per added node, the same bundle and strategy):
the run's added replica groups go there (``ResizeRequest.placement``). The trainer
gives it back once those groups drained (``stages.placement.release_added``), else it
is removed when the run ends; on the embedded head (one machine) there is none, the
run's own group serves.

The embedded head (no ``--ray-address``) is one machine that serves every booking:
it is marked with the bookings registered when it starts and with the catch-all
``EMBEDDED_RESOURCE``, which this module uses only for a booking that has no node of
its own and only when the backend runs its own embedded head.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.db.engines import Row
from stages.errors import ErrorCode
from stages.placement import (
    NODE_RESOURCE_PREFIX,
    added_group_name,
    booking_resource,
    node_resource,
)
from stages.run_facts import PlacementFact

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

EMBEDDED_RESOURCE = "ito-embedded"
# The catch-all's amount on the embedded head: plenty for any number of bookings
# (the head's CPUs, reserved whole by each run, are what serialises runs there).
EMBEDDED_RESOURCE_AMOUNT = 1_000_000.0


class PlacementSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # How long a run waits in ``starting`` (or, after a node loss, before its
    # relaunch) for its booking's nodes to be live and free, then fails.
    wait_timeout_s: float = Field(default=600.0, gt=0)
    # One bundle per booked node, each on a different node.
    strategy: str = Field(
        default="STRICT_SPREAD", pattern="^(STRICT_SPREAD|SPREAD|PACK|STRICT_PACK)$"
    )
    # CPUs reserved per bundle; None: the smallest CPU count among the booking's live
    # nodes (the booking paid for whole nodes).
    cpus_per_bundle: float | None = Field(default=None, gt=0)


class BookingRow(TypedDict):
    """What placement reads of a booking's store row (``bookings``): its id, and its
    nodes and GPUs per node (NULL: one)."""

    booking_id: str
    node_count: int | None
    gpus_per_node: int | None


def booking_row(row: Row) -> BookingRow:
    """``BookingRow`` of a store row (of ``bookings``, or any row with a booking id)."""
    return BookingRow(
        booking_id=row["booking_id"],
        node_count=row.get("node_count"),
        gpus_per_node=row.get("gpus_per_node"),
    )


def pg_name(run_id: str) -> str:
    return f"run-{run_id}-pg"


def added_pg_name(run_id: str, change_id: int) -> str:
    """The group of the nodes a booking change gave the run."""
    return added_group_name(pg_name(run_id), change_id)


def embedded_marks(bookings: list[BookingRow]) -> dict[str, float]:
    """Custom resources of the embedded head: every given booking, plus the catch-all."""
    marks = {
        booking_resource(b["booking_id"]): float(b.get("gpus_per_node") or 1) for b in bookings
    }
    marks[EMBEDDED_RESOURCE] = EMBEDDED_RESOURCE_AMOUNT
    return marks


@dataclass
class Waiting:
    """The group is not there yet: why, and which code the run fails with at the end."""

    reason: str
    code: ErrorCode


# ``_live_nodes``' resource for every live node.
BOOKING_NODES_ANY = ""


def _live_nodes(resource: str) -> list[dict[str, Any]]:
    """The live nodes that have ``resource`` (every live one for ``BOOKING_NODES_ANY``)."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [
        n
        for n in nodes
        if n.get("Alive") and (not resource or resource in (n.get("Resources") or {}))
    ]


def _pinned(
    bundle: dict[str, float],
    resource: str,
    nodes: Sequence[str],
    count: int,
    booking_nodes: Sequence[str],
) -> list[dict[str, float]]:
    """``count`` bundles, each on the booking node of its name (``nodes``) where the
    booking's nodes (``booking_nodes``, all of them) carry their names, else on any
    node of the booking."""
    if len(nodes) != count or not names_nodes(resource, booking_nodes):
        return [dict(bundle) for _ in range(count)]
    return [{**bundle, node_resource(name): 1.0} for name in nodes]


def names_nodes(resource: str, booking_nodes: Sequence[str]) -> bool:
    """Whether the live nodes marked ``resource`` carry the names the booking gives
    its nodes (``booking-node:<name>``, set by ``ray start`` in deploy/slurm and
    deploy/k8s). A raylet named otherwise (its host name, where the booking lists
    names of its own) does not count: bundles pinned to names no node carries would
    wait forever."""
    wanted = {node_resource(name) for name in booking_nodes}
    return any(k in wanted for n in _live_nodes(resource) for k in n["Resources"])


def node_ids(names: Sequence[str]) -> tuple[str, ...]:
    """The live Ray nodes (hex ids) that are booking nodes ``names``, in their order;
    empty unless every name is one live node's (the mapping is all or nothing: a
    trainer that knows only some nodes would drain the groups on the others)."""
    found: dict[str, str] = {}
    for n in _live_nodes(BOOKING_NODES_ANY):
        for key in n["Resources"]:
            if key.startswith(NODE_RESOURCE_PREFIX):
                found[key[len(NODE_RESOURCE_PREFIX) :]] = str(n["NodeID"])
    ids = tuple(found.get(name, "") for name in names)
    return ids if ids and all(ids) else ()


def _mark_for(booking: BookingRow, embedded: bool) -> str:
    mark = booking_resource(booking["booking_id"])
    if not _live_nodes(mark) and embedded and _live_nodes(EMBEDDED_RESOURCE):
        return EMBEDDED_RESOURCE
    return mark


def diagnose(booking: BookingRow, resource: str, bundles: int) -> Waiting:
    """Why a run's group is not placed (yet), in words an SRE can act on."""
    live = _live_nodes(resource)
    bid = booking["booking_id"]
    if not live:
        return Waiting(
            f"waiting for booking {bid}'s nodes: no live node is marked "
            f"{resource} (0 of {bundles} joined)",
            ErrorCode.booking_nodes_unavailable,
        )
    if len(live) < bundles:
        return Waiting(
            f"waiting for booking {bid}'s nodes: {len(live)} of {bundles} joined",
            ErrorCode.booking_nodes_unavailable,
        )
    return Waiting(
        f"waiting for booking {bid}'s nodes: {len(live)} live but busy (another "
        "run of the booking holds them) or smaller than booked",
        ErrorCode.placement_timeout,
    )


def unplaceable(
    booking: BookingRow, settings: PlacementSettings, *, embedded: bool
) -> Waiting | None:
    """Why the run's group cannot even be requested yet (too few marked nodes live),
    or None. The group is created only once every booked node has joined, so its
    bundles are sized from the nodes themselves."""
    resource = _mark_for(booking, embedded)
    nodes = 1 if resource == EMBEDDED_RESOURCE else int(booking.get("node_count") or 1)
    if len(_live_nodes(resource)) >= nodes:
        return None
    return diagnose(booking, resource, nodes)


def _bundle(
    booking: BookingRow, resource: str, settings: PlacementSettings, embedded: bool
) -> dict[str, float]:
    gpus = float(booking.get("gpus_per_node") or 1)
    live = _live_nodes(resource)
    bundle = {resource: gpus}
    cpus = settings.cpus_per_bundle or min(
        (float(n["Resources"].get("CPU", 0)) for n in live), default=0.0
    )
    if cpus > 0:
        bundle["CPU"] = cpus
    if live and min(float(n["Resources"].get("GPU", 0)) for n in live) >= gpus and not embedded:
        bundle["GPU"] = gpus
    return bundle


def lookup(run_id: str, name: str | None = None) -> PlacementGroup | None:
    from ray.util import get_placement_group

    try:
        pg: PlacementGroup = get_placement_group(name or pg_name(run_id))
    except ValueError:
        return None
    return pg


def reserve_added(
    run_id: str,
    change_id: int,
    booking: BookingRow,
    nodes: Sequence[str],
    settings: PlacementSettings,
    *,
    embedded: bool,
    booking_nodes: Sequence[str] = (),
) -> PlacementFact | None:
    """The group of the booking nodes ``nodes`` a booking change added (idempotent by
    name), a bundle on each where the booking's nodes (``booking_nodes``: all of them
    now) carry their names; None on the embedded head (the run's own group serves).
    Raises ``PlacementPending`` until Ray created it (the added nodes joined and are
    free)."""
    from ray.util.placement_group import placement_group

    if embedded:  # one machine: the run's own group serves
        return None
    resource = _mark_for(booking, embedded)
    name = added_pg_name(run_id, change_id)
    pg = lookup(run_id, name)
    if pg is None:
        bundle = _bundle(booking, resource, settings, False)
        pg = placement_group(
            _pinned(bundle, resource, nodes, len(nodes), booking_nodes or nodes),
            strategy=settings.strategy,
            name=name,
            lifetime="detached",
        )
    if state(pg) != "CREATED":
        raise PlacementPending(
            f"waiting for the {len(nodes)} added node(s) of the booking ({', '.join(nodes)})"
        )
    return fact(run_id, booking, pg, name=name)


class PlacementPending(Exception):
    """The added nodes' group is not created yet (they have not joined, or are busy)."""


def reserve(
    run_id: str,
    booking: BookingRow,
    settings: PlacementSettings,
    *,
    embedded: bool,
    nodes: Sequence[str] = (),
) -> PlacementGroup:
    """Create the run's group (idempotent by name), a bundle on each of the booking's
    ``nodes`` where they carry their names; it may stay pending."""
    from ray.util.placement_group import placement_group

    existing = lookup(run_id)
    if existing is not None:
        return existing
    resource = _mark_for(booking, embedded)
    on_embedded = resource == EMBEDDED_RESOURCE
    count = 1 if on_embedded else int(booking.get("node_count") or 1)
    bundle = _bundle(booking, resource, settings, on_embedded)
    pg: PlacementGroup = placement_group(
        [dict(bundle) for _ in range(count)]
        if on_embedded
        else _pinned(bundle, resource, nodes, count, nodes),
        strategy="PACK" if on_embedded else settings.strategy,
        name=pg_name(run_id),
        lifetime="detached",
    )
    return pg


def state(pg: PlacementGroup) -> str:
    """PENDING, CREATED, REMOVED or RESCHEDULING (a node of the group died)."""
    from ray.util import placement_group_table

    return str(placement_group_table(pg).get("state", "PENDING"))


def fact(
    run_id: str, booking: BookingRow, pg: PlacementGroup, *, name: str | None = None
) -> PlacementFact:
    from ray.util import placement_group_table

    table = placement_group_table(pg)
    bundles = [dict(b) for b in table["bundles"].values()]
    resource = next(k for k in bundles[0] if k.startswith("booking:") or k == EMBEDDED_RESOURCE)
    return PlacementFact(
        booking_id=booking["booking_id"],
        resource=resource,
        placement_group=name or pg_name(run_id),
        placement_group_id=pg.id.hex(),
        bundles=len(bundles),
        # One bundle's resources, less the node name it may be pinned to.
        bundle={k: v for k, v in bundles[0].items() if not k.startswith(NODE_RESOURCE_PREFIX)},
    )


def release(run_id: str) -> bool:
    """Remove the run's group and the groups of nodes its booking gained."""
    from ray.util import placement_group_table, remove_placement_group

    prefix = added_pg_name(run_id, 0)[:-1]
    names = [
        t["name"]
        for t in placement_group_table().values()
        if str(t.get("name", "")).startswith(prefix) and t.get("state") != "REMOVED"
    ]
    removed = False
    for name in [pg_name(run_id), *names]:
        pg = lookup(run_id, name)
        if pg is None:
            continue
        try:
            remove_placement_group(pg)
            removed = True
        except Exception:  # already removed
            continue
    return removed


class Waiter:
    """Tracks how long each run has waited for its group (monotonic, per process)."""

    def __init__(self, settings: PlacementSettings):
        self.settings = settings
        self._since: dict[str, float] = {}

    def waited(self, run_id: str) -> float:
        return time.monotonic() - self._since.setdefault(run_id, time.monotonic())

    def expired(self, run_id: str) -> bool:
        return self.waited(run_id) > self.settings.wait_timeout_s

    def done(self, run_id: str) -> None:
        self._since.pop(run_id, None)
