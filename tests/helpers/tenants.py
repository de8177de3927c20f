"""Accounts, keys and bookings, through the store directly or the admin CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from orchestrator.db.store import Store
from orchestrator.gates.auth import SCOPES, issue_key
from orchestrator.gates.bookings import BookingFile, add_booking

SUBMITTER = ("runs:read", "runs:write")
APPROVER = (*(s for s in SCOPES if s.startswith("confirm:")), "runs:read")
ADMIN_TIMEOUT_S = 60.0


def iso_in(hours: float) -> str:
    t = datetime.now(UTC) + timedelta(hours=hours)
    return t.isoformat().replace("+00:00", "Z")


def booking_doc(booking_id: str, account: str, **over: Any) -> dict[str, Any]:
    """A complete, active booking: 1 node x 8 H100-SXM on ib-ndr, term now-1h..now+24h."""
    doc: dict[str, Any] = {
        "booking_id": booking_id,
        "account": account,
        "gpu_sku": "H100-SXM",
        "gpus_per_node": 8,
        "node_count": 1,
        "region": "eu-west",
        "fabric": "ib-ndr",
        "term_start": iso_in(-1),
        "term_end": iso_in(24),
    }
    doc.update(over)
    return {k: v for k, v in doc.items() if v is not None}


def cpu_booking_doc(
    booking_id: str, account: str, gpus: int = 2, nodes: int = 1, **over: Any
) -> dict[str, Any]:
    """A booking of the CPU testbed (``cpu-testbed`` ranks over ``loopback``): what the
    demo and Ray tests actually run on; the planner accepts llama-tiny on it."""
    return booking_doc(
        booking_id,
        account,
        gpu_sku="cpu-testbed",
        gpus_per_node=gpus,
        node_count=nodes,
        fabric="loopback",
        region="local",
        **over,
    )


@dataclass
class Tenant:
    account: str
    keys: dict[str, str] = field(default_factory=dict)  # role -> api key
    key_ids: dict[str, str] = field(default_factory=dict)
    bookings: list[str] = field(default_factory=list)

    @property
    def booking_id(self) -> str:
        return self.bookings[0]

    @property
    def submitter(self) -> str:
        return self.keys["submitter"]

    @property
    def approver(self) -> str:
        return self.keys["approver"]


# Tests keep data and checkpoints in pytest's temp folders: the default tenant's roots
# are the temp folder (the isolation tests set narrow roots of their own).
DEFAULT_ROOTS = (os.path.realpath(tempfile.gettempdir()),)


def make_tenant(
    db: str | Path,
    name: str,
    roles: dict[str, tuple[str, ...]] | None = None,
    booking: dict[str, Any] | None = None,
    with_booking: bool = True,
    data_roots: tuple[str, ...] = DEFAULT_ROOTS,
    checkpoint_roots: tuple[str, ...] = DEFAULT_ROOTS,
) -> Tenant:
    """Account + keys per role (default submitter and approver) + one booking, via Store."""
    store = Store(db)
    try:
        row = store.create_account(name)
        store.set_roots(row["account_id"], "data", list(data_roots))
        store.set_roots(row["account_id"], "checkpoint", list(checkpoint_roots))
        t = Tenant(name)
        for role, scopes in (roles or {"submitter": SUBMITTER, "approver": APPROVER}).items():
            t.key_ids[role], t.keys[role] = issue_key(store, name, list(scopes))
        if with_booking:
            doc = booking or booking_doc(f"bk-{name}", name)
            add_booking(store, BookingFile.model_validate(doc))
            t.bookings.append(doc["booking_id"])
        return t
    finally:
        store.close()


def add_tenant_booking(db: str | Path, tenant: Tenant, doc: dict[str, Any]) -> None:
    """Another booking for ``tenant`` (a booking document), via Store."""
    store = Store(db)
    try:
        add_booking(store, BookingFile.model_validate(doc))
        tenant.bookings.append(doc["booking_id"])
    finally:
        store.close()


def add_key(db: str | Path, account: str, scopes: tuple[str, ...]) -> tuple[str, str]:
    store = Store(db)
    try:
        return issue_key(store, account, list(scopes))
    finally:
        store.close()


def admin(db: str | Path, *args: str, check: bool = True) -> dict[str, Any]:
    """Run ``ito-backend <args> --db DB --json`` as a subprocess; returns the envelope."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.admin", *args, "--db", str(db), "--json"],
        capture_output=True,
        text=True,
        timeout=ADMIN_TIMEOUT_S,
    )
    env: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if check and (proc.returncode != 0 or not env["ok"]):
        raise AssertionError(f"admin {args} failed: {proc.stdout} {proc.stderr}")
    return env


def add_booking_cli(db: str | Path, tmp: Path, doc: dict[str, Any]) -> dict[str, Any]:
    path = tmp / f"booking-{doc['booking_id']}.json"
    path.write_text(json.dumps(doc))
    return admin(db, "bookings", "add", str(path))
