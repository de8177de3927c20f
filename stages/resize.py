"""A running run's replica-group count following its booking.

When a booking gains or loses nodes, the orchestrator asks the planner for the run's
new group count (the layout inside each group unchanged) and hands the run a
:class:`ResizeRequest` through ``StageContext.resize_inbox``. The trainer applies it
at a step boundary: new groups heal from a live peer and join the quorum, leaving
groups are drained (they finish their step and stop, nothing is killed mid-step), and
the global batch stays fixed, so every data-parallel rank's share is re-cut. Each
applied resize is reported as a ``ResizeEvent``. Stages never import the
orchestrator: this module is the whole contract between them.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping

from pydantic import BaseModel, ConfigDict, Field

from stages.run_facts import PlacementFact


class ResizeRequest(BaseModel):
    """The run's new replica-group count, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    # 0: the booking holds no whole group any more; the run checkpoints and pauses.
    replica_groups: int = Field(ge=0, le=64)
    # The booking's nodes after the change (names, for people and the record).
    nodes: tuple[str, ...] = ()
    # When the booking changed (epoch seconds): the resize's time counts from here.
    requested_at: float
    reason: str = Field(default="", max_length=500)
    # Where added groups go: the reservation of the nodes the booking gained (None:
    # the run's own placement, or none in a stage run alone).
    placement: PlacementFact | None = None
    # Groups to drain first, by index (empty: the groups off ``node_ids``, else the
    # highest).
    leaving_groups: tuple[int, ...] = ()
    # The Ray nodes (hex ids) the booking's nodes are after the change, one per name of
    # ``nodes``; empty where that is not known (a raylet not started with its node's
    # name, a node not joined, one machine serving the booking). A group with a rank on
    # a Ray node not listed leaves; unknown, the highest groups leave.
    node_ids: tuple[str, ...] = ()


def groups_off_booking(
    rank_nodes: Mapping[tuple[int, int], str], booking_nodes: Collection[str]
) -> tuple[int, ...]:
    """The replica groups with a rank on a Ray node the booking no longer holds, from
    each rank's node (``(group, rank) -> node id``). None where the mapping is not
    known: no booking node ids, or a rank whose node is unknown ("")."""
    if not booking_nodes or not rank_nodes or not all(rank_nodes.values()):
        return ()
    return tuple(sorted({g for (g, _), node in rank_nodes.items() if node not in booking_nodes}))


class ResizeInbox:
    """The requests not yet taken by the trainer. A newer request replaces an untaken
    older one (only the booking's latest size matters); ``take`` is non-blocking, so
    the trainer checks it on its way round its supervision loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: ResizeRequest | None = None

    def put(self, request: ResizeRequest) -> None:
        with self._lock:
            self._pending = request

    def take(self) -> ResizeRequest | None:
        with self._lock:
            request, self._pending = self._pending, None
            return request

    def peek(self) -> ResizeRequest | None:
        with self._lock:
            return self._pending
