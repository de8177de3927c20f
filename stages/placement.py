"""Where a run's actors may go: only onto its booking's nodes.

A node joins the Ray cluster marked with the booking it belongs to: a custom
resource ``booking:<booking_id>`` whose amount is the node's GPU count (deploy/slurm
and deploy/k8s set it with ``ray start --resources``). Before a run's driver exists,
the orchestrator reserves the booking's nodes for the run with one placement group
(``run-<id>-pg``, one bundle per booked node, gang-scheduled) and hands the stages
its coordinates as ``ctx.facts.placement`` (a :class:`PlacementFact`, one field of
the run's ``stages.run_facts.RunFacts``).

Every actor or task a stage creates must be scheduled into that group, so it lands
on the booking's nodes and nowhere else. Stages never import the orchestrator, so
this module is the one helper they use::

    from stages.placement import actor_options
    opts = actor_options(ctx.facts, bundle_index=bundle_for_rank(ctx.facts, rank, world))
    Worker.options(name=..., num_cpus=0.5, **opts).remote(...)

With no placement (a stage run alone, in a unit test) ``actor_options``
returns ``{}`` and Ray schedules as it likes. The driver itself is scheduled into
the group with ``placement_group_capture_child_tasks=True``, so work a stage
forgets to place still stays in the group; placing it explicitly is still the rule
(it pins ranks to bundles, i.e. to nodes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from stages.run_facts import PlacementFact as PlacementFact  # re-exported: its old home
from stages.run_facts import RunFacts

BOOKING_RESOURCE_PREFIX = "booking:"
# A booked node's own name, as the booking lists it: a custom resource (amount 1) each
# raylet is started with beside the booking's mark, so the orchestrator knows which Ray
# node is booking node X (a node label would not do: booking node names may hold ":"
# and be 128 characters long, beyond a label's).
NODE_RESOURCE_PREFIX = "booking-node:"
# What every placed actor takes of the booking's mark inside its bundle: a token
# amount that pins it to a bundle of the booking's nodes even when it asks for no
# CPU or GPU (a zero-resource actor would otherwise be free to go anywhere).
MARK_PER_ACTOR = 0.001


# A run's reservations: its own group, and one per booking change that gave the
# running run nodes, named ``<its own group>-c<change>`` (the orchestrator makes them).
_ADDED_GROUP = re.compile(r"^(?P<run>.+)-c[0-9]+$")


def added_group_name(run_group: str, change_id: int) -> str:
    """The reservation of the nodes booking change ``change_id`` gave a running run."""
    return f"{run_group}-c{change_id}"


def run_group_of(group_name: str) -> str:
    """The run's own group's name, from the name of any of the run's reservations."""
    m = _ADDED_GROUP.match(group_name)
    return m["run"] if m else group_name


def release_added(placement: PlacementFact) -> bool:
    """Give back the reservation of nodes a booking change gave the running run, once
    the groups placed in it drained (removing it kills what still runs there). Never
    the run's own: that is the orchestrator's, at the run's end. Whether it was one."""
    if run_group_of(placement.placement_group) == placement.placement_group:
        return False
    import contextlib

    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    with contextlib.suppress(Exception):  # already removed (a relaunched driver's twin)
        remove_placement_group(
            PlacementGroup(PlacementGroupID(bytes.fromhex(placement.placement_group_id)))
        )
    return True


def booking_resource(booking_id: str) -> str:
    """The custom resource that marks a node as belonging to ``booking_id``."""
    return f"{BOOKING_RESOURCE_PREFIX}{booking_id}"


def node_resource(node: str) -> str:
    """The custom resource that names a Ray node as booking node ``node``."""
    return f"{NODE_RESOURCE_PREFIX}{node}"


def placement_fact(facts: RunFacts | None) -> PlacementFact | None:
    """The run's reservation; None for a stage run alone."""
    return facts.placement if facts is not None else None


def bundle_for_rank(facts: RunFacts | None, rank: int, world: int) -> int:
    """Spread ``world`` ranks evenly over the bundles (nodes), consecutive ranks together
    (so a replica group's ranks share a node when they fit). -1 without placement."""
    p = placement_fact(facts)
    if p is None or world <= 0:
        return -1
    return min(p.bundles - 1, rank * p.bundles // world)


def bundle_for_group_rank(
    facts: RunFacts | None, rank: int, ranks_per_group: int, place: int, groups: int
) -> int:
    """The bundle of rank ``rank`` of the replica group at ``place`` among the ``groups``
    groups a reservation holds: the groups' ranks spread over its bundles in turn, so
    each group has bundles (nodes) of its own when there are as many. -1 without
    placement."""
    return bundle_for_rank(facts, place * ranks_per_group + rank, groups * ranks_per_group)


def actor_options(
    facts: RunFacts | None,
    *,
    bundle_index: int = -1,
    resources: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """``.options(**...)`` kwargs that schedule an actor or task into the run's group.

    ``resources`` are the caller's own custom resources, merged with the mark token.
    Returns ``{}`` when the run has no placement (a stage run alone)."""
    p = placement_fact(facts)
    if p is None:
        return {"resources": dict(resources)} if resources else {}
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = PlacementGroup(PlacementGroupID(bytes.fromhex(p.placement_group_id)))
    merged = dict(resources or {})
    merged[p.resource] = merged.get(p.resource, 0.0) + MARK_PER_ACTOR
    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        ),
        "resources": merged,
    }
