"""The booking registry (fed by ito-compute; here by ``ito-backend bookings add``)
and the eligibility gate.

Eligibility is computed fresh from the registry on every request and bound to
account, booking, topology, region, fabric and term. Node IPs, SSH access, quotes
or a client's memory are never proof of a booking.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.db.store import Row, Store
from orchestrator.redact import safe_id
from stages.errors import ErrorCode, ItoError
from stages.parallelism.hardware import canonical_name


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def parse_iso(value: str) -> float:
    dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        raise ValueError("times need a timezone (e.g. Z)")
    return dt.timestamp()


# A node's name: what ito-compute calls the host (and Ray's node resource may carry).
NODE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_NODES = 100_000


def check_node_names(nodes: Sequence[str]) -> list[str]:
    """A node list as given: non-empty, each name well formed, none twice."""
    if not nodes:
        raise ItoError(ErrorCode.booking_nodes_invalid, "name at least one node")
    if len(nodes) > MAX_NODES:
        raise ItoError(ErrorCode.booking_nodes_invalid, f"at most {MAX_NODES} nodes")
    for name in nodes:
        if not isinstance(name, str) or not NODE_NAME.match(name):
            raise ItoError(
                ErrorCode.booking_nodes_invalid,
                "a node name is 1-128 characters of letters, digits and _.:-",
            )
    if len(set(nodes)) != len(nodes):
        raise ItoError(ErrorCode.booking_nodes_invalid, "a node is named twice")
    return list(nodes)


def derived_node_names(booking_id: str, node_count: int) -> list[str]:
    """The names of a booking registered without ``nodes`` (and of every booking a
    database held before bookings had named nodes: the store's migration 4)."""
    return [f"{booking_id}-n{i}" for i in range(node_count)]


class BookingFile(BaseModel):
    """One booking as ito-compute hands it over. Topology/region/fabric may be missing
    (an incomplete booking is registered, then refused at the gate)."""

    model_config = ConfigDict(extra="forbid")
    booking_id: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    account: str = Field(min_length=1, max_length=128)
    gpu_sku: str | None = Field(default=None, max_length=64)
    gpus_per_node: int | None = Field(default=None, gt=0, le=1024)
    node_count: int | None = Field(default=None, gt=0, le=100_000)
    # The nodes' names (ito-compute's host names); without it the registry names them
    # ``<booking_id>-n0`` .. ``-n<node_count - 1>``. Checked by ``check_node_names``.
    nodes: list[str] | None = Field(default=None, max_length=MAX_NODES)
    region: str | None = Field(default=None, max_length=64)
    fabric: str | None = Field(default=None, max_length=64)
    term_start: str
    term_end: str

    @field_validator("term_start", "term_end")
    @classmethod
    def _iso(cls, v: str) -> str:
        parse_iso(v)
        return v


def add_booking(store: Store, booking: BookingFile) -> dict[str, Any]:
    account = store.account_by_name(booking.account)
    if account is None:
        raise ItoError(ErrorCode.not_found, f"no account {booking.account!r}")
    start, end = parse_iso(booking.term_start), parse_iso(booking.term_end)
    if end <= start:
        raise ItoError(ErrorCode.bad_request, "term_end must be after term_start")
    row = booking.model_dump()
    # SKU and fabric are checked now, not first at confirmation; upstream spellings
    # ("InfiniBand NDR", "infiniband-ndr") are stored as the profile name ("ib-ndr").
    # A missing one is kept missing: the eligibility gate refuses it as incomplete.
    if booking.gpu_sku is not None:
        row["gpu_sku"] = canonical_name("gpus", booking.gpu_sku)
    if booking.fabric is not None:
        row["fabric"] = canonical_name("fabrics", booking.fabric)
    if booking.nodes is not None:
        nodes = check_node_names(booking.nodes)
        if booking.node_count is not None and booking.node_count != len(nodes):
            raise ItoError(
                ErrorCode.booking_nodes_invalid,
                f"node_count {booking.node_count} but {len(nodes)} nodes listed",
            )
    else:
        nodes = derived_node_names(booking.booking_id, booking.node_count or 0)
    row.update(
        account_id=account["account_id"],
        term_start=start,
        term_end=end,
        nodes=nodes,
        node_count=len(nodes) or None,
    )
    store.add_booking(row)
    return booking_view(store, booking.booking_id)


def booking_view(store: Store, booking_id: str) -> dict[str, Any]:
    row = store.booking(booking_id)
    if row is None:
        raise ItoError(ErrorCode.booking_not_found, f"no booking {safe_id(booking_id)}")
    account = store.account(row["account_id"])
    return {
        "booking_id": row["booking_id"],
        "account": account["name"] if account else None,
        "gpu_sku": row["gpu_sku"],
        "gpus_per_node": row["gpus_per_node"],
        "node_count": row["node_count"],
        "nodes": store.booking_nodes(booking_id),
        "region": row["region"],
        "fabric": row["fabric"],
        "term_start": iso(row["term_start"]),
        "term_end": iso(row["term_end"]),
        "state": row["state"],
    }


def owned_live_booking(store: Store, booking_id: str, account_id: str) -> Row:
    """The account's booking, neither revoked nor released; else its own code."""
    row = store.booking(booking_id)
    # Another account's booking answers exactly as a missing one (same code, status and
    # message), so a tenant cannot learn which booking ids exist.
    if row is None or row["account_id"] != account_id:
        raise ItoError(ErrorCode.booking_not_found, f"no booking {safe_id(booking_id)}")
    if row["state"] == "revoked":
        raise ItoError(ErrorCode.booking_revoked, "this booking was revoked")
    if row["state"] == "released":
        raise ItoError(ErrorCode.booking_released, "this booking was released")
    return row


def check_eligibility(
    store: Store, booking_id: str, account_id: str, ttl_s: int, now: float | None = None
) -> dict[str, Any]:
    """Fail closed, each reason its own code; else fresh eligibility bound to the booking."""
    now = time.time() if now is None else now
    row = owned_live_booking(store, booking_id, account_id)
    missing = [
        k
        for k in ("gpu_sku", "gpus_per_node", "node_count", "region", "fabric")
        if row[k] in (None, "", 0)  # 0 nodes: every node was taken back
    ]
    if missing:
        raise ItoError(ErrorCode.booking_incomplete, f"booking lacks {', '.join(missing)}")
    if now < row["term_start"]:
        raise ItoError(
            ErrorCode.booking_not_started, f"booking term starts at {iso(row['term_start'])}"
        )
    if now >= row["term_end"]:
        raise ItoError(ErrorCode.booking_expired, f"booking term ended at {iso(row['term_end'])}")
    view = booking_view(store, booking_id)
    view.pop("state")
    return {
        **view,
        "eligible": True,
        "checked_at": iso(now),
        "valid_until": iso(min(now + ttl_s, row["term_end"])),
        "_term_end_ts": row["term_end"],
    }


def change_nodes(
    store: Store, booking_id: str, action: str, nodes: Sequence[str]
) -> dict[str, Any]:
    """Add nodes to (``action="add"``) or remove nodes from an active booking; the
    booking's view after it, with the change's ``change_id``. A running run of the
    booking follows at the supervisor's next authority check (``runtime.resizing``)."""
    change = store.change_booking_nodes(booking_id, action, check_node_names(nodes))
    return {**booking_view(store, booking_id), "change_id": change["change_id"]}
