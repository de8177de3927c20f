"""One-time confirmations: the approver's consent, bound to account, action, booking,
manifest digest or run, and cost; short-lived and consumed exactly once.

The client holds only an opaque reference (256 random bits) that authorizes
nothing by itself; the server stores its sha256 and resolves it at the mutation,
consuming it in the same transaction that performs the mutation.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Literal

from orchestrator.db.store import Conn, Row, Store
from orchestrator.gates.auth import Principal, sha256_hex
from stages.errors import ErrorCode, ItoError

Action = Literal["train", "cancel", "cleanup", "release", "restart"]
REF_PREFIX = "itoc_"
# Estimates are floats; a confirmation equal to the estimate up to rounding covers it.
COST_EPSILON_USD = 1e-6


def new_ref() -> str:
    return REF_PREFIX + secrets.token_urlsafe(32)


def ref_hash(ref: str) -> str:
    return sha256_hex(ref)


def create(
    store: Store,
    principal: Principal,
    *,
    action: Action,
    booking_id: str,
    cost_usd: float,
    ttl_s: int,
    manifest_digest: str | None = None,
    run_id: str | None = None,
    proposal_id: str | None = None,
) -> tuple[str, Row]:
    ref, now = new_ref(), time.time()
    row = {
        "ref_sha256": ref_hash(ref),
        "account_id": principal.account_id,
        "action": action,
        "booking_id": booking_id,
        "manifest_digest": manifest_digest,
        "run_id": run_id,
        "proposal_id": proposal_id,
        "cost_usd": float(cost_usd),
        "created_by_key": principal.key_id,
        "created_at": now,
        "expires_at": now + ttl_s,
    }
    store.insert_confirmation(row)
    return ref, row


@dataclass(frozen=True)
class Expect:
    """What the mutation needs the confirmation to be bound to."""

    account_id: str
    action: Action
    booking_id: str
    cost_usd: float = 0.0
    manifest_digest: str | None = None
    run_id: str | None = None
    proposal_id: str | None = None
    # The key that uses the confirmation; it must not be the key that made it.
    used_by_key: str | None = None


def check(row: Row | None, expect: Expect, now: float | None = None) -> Row:
    """Resolve a confirmation against what the mutation needs; each mismatch its own code."""
    now = time.time() if now is None else now
    if row is None:
        raise ItoError(ErrorCode.confirmation_not_found, "unknown confirmation reference")
    if row["account_id"] != expect.account_id:
        raise ItoError(
            ErrorCode.confirmation_account_mismatch, "the confirmation belongs to another account"
        )
    if row["consumed_at"] is not None:
        raise ItoError(ErrorCode.confirmation_consumed, "the confirmation was already used")
    if now >= row["expires_at"]:
        raise ItoError(ErrorCode.confirmation_expired, "the confirmation expired")
    if row["action"] != expect.action:
        raise ItoError(
            ErrorCode.confirmation_action_mismatch,
            f"the confirmation is for {row['action']}, not {expect.action}",
        )
    if row["booking_id"] != expect.booking_id:
        raise ItoError(
            ErrorCode.confirmation_booking_mismatch, "the confirmation is for another booking"
        )
    if expect.manifest_digest is not None and row["manifest_digest"] != expect.manifest_digest:
        raise ItoError(
            ErrorCode.confirmation_digest_mismatch,
            "the confirmation is for another manifest digest",
        )
    if (expect.run_id is not None and row["run_id"] != expect.run_id) or (
        expect.proposal_id is not None and row["proposal_id"] != expect.proposal_id
    ):
        raise ItoError(
            ErrorCode.confirmation_run_mismatch, "the confirmation is for another run or proposal"
        )
    if expect.used_by_key is not None and row["created_by_key"] == expect.used_by_key:
        raise ItoError(
            ErrorCode.confirmation_self_approved,
            "a confirmation must come from an approver's key, not the submitter's",
        )
    if row["cost_usd"] + COST_EPSILON_USD < expect.cost_usd:
        raise ItoError(
            ErrorCode.confirmation_cost_exceeded,
            f"the estimated cost ${expect.cost_usd:,.2f} exceeds the confirmed "
            f"${row['cost_usd']:,.2f}",
        )
    return row


def resolve(store: Store, ref: str | None, expect: Expect, conn: Conn | None = None) -> Row:
    if not ref:
        raise ItoError(ErrorCode.confirmation_required, "a confirmation_ref is required")
    if not ref.startswith(REF_PREFIX) or len(ref) > 128:
        raise ItoError(ErrorCode.confirmation_not_found, "unknown confirmation reference")
    return check(store.confirmation(ref_hash(ref), conn), expect)


def consume(store: Store, conn: Conn, ref: str, expect: Expect, by: str) -> Row:
    """Re-check under the write lock and consume: exactly one caller wins.

    Credentials end with their key: the key that made the confirmation must still be
    live (not revoked) and its account not disabled, checked in this transaction."""
    row = resolve(store, ref, expect, conn)
    maker = conn.execute(
        "SELECT k.revoked_at, a.disabled_at FROM api_keys AS k JOIN accounts AS a "
        "ON a.account_id = k.account_id WHERE k.key_id = ?",
        (row["created_by_key"],),
    ).fetchone()
    if maker is None or maker["revoked_at"] is not None:
        raise ItoError(
            ErrorCode.credential_revoked,
            "the key that made this confirmation was revoked; confirm again",
        )
    if maker["disabled_at"] is not None:
        raise ItoError(ErrorCode.account_disabled, "this account is disabled")
    store.consume_confirmation(conn, row["ref_sha256"], by)
    return row
