"""Whether a run still has the authority it was accepted with.

A run is accepted against a live booking of an enabled account, inside the
booking's term. Any of those can end while the run is queued or running: the
booking is revoked or released upstream, the operator disables the account, or
the term simply runs out. The supervisor asks ``lapsed`` about every active run
on a bounded interval and stops a lapsed one with the code returned here, so
work (and spend) never outlives the authority that paid for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.db.store import Row, Store
from orchestrator.gates.bookings import iso
from stages.errors import ErrorCode


@dataclass(frozen=True)
class Lapse:
    code: ErrorCode
    reason: str

    def state_reason(self) -> str:
        """The run's state reason: the stable code first, as every failure reads."""
        return f"{self.code}: {self.reason}"


def lapsed(store: Store, run: Row, now: float | None = None) -> Lapse | None:
    """Why ``run`` may no longer use its booking, or None while it still may."""
    now = time.time() if now is None else now
    account = store.account(run["account_id"])
    if account is None or account["disabled_at"] is not None:
        return Lapse(ErrorCode.account_disabled, "the run's account was disabled")
    booking = store.booking(run["booking_id"])
    if booking is None or booking["account_id"] != run["account_id"]:
        return Lapse(ErrorCode.booking_revoked, "the run's booking is no longer registered")
    if booking["state"] == "revoked":
        return Lapse(ErrorCode.booking_revoked, "the run's booking was revoked")
    if booking["state"] == "released":
        return Lapse(ErrorCode.booking_released, "the run's booking was released")
    if now >= booking["term_end"]:
        return Lapse(
            ErrorCode.booking_term_ended, f"the booking's term ended at {iso(booking['term_end'])}"
        )
    return None


def stop_code(state_reason: str) -> str | None:
    """The stable code a stop was requested with (``"<code>: why"``), if any."""
    head, sep, _ = state_reason.partition(":")
    if sep and head in ErrorCode.__members__:
        return head
    return None
