"""The one run state enum and the one transition table.

Every state change of a run goes through ``check_transition``; anything not in the
table is ``invalid_state``. The API, the store and the runtime share this table.
"""

from __future__ import annotations

from enum import StrEnum

from stages.errors import ErrorCode, ItoError


class RunState(StrEnum):
    accepted = "accepted"
    starting = "starting"
    running = "running"
    awaiting_approval = "awaiting_approval"
    # The booking holds less than one replica group (nodes taken back): the run
    # checkpointed and waits; it runs again when the booking has the nodes back.
    paused_capacity = "paused_capacity"
    cancelling = "cancelling"
    cancelled = "cancelled"
    succeeded = "succeeded"
    failed = "failed"
    cleaned = "cleaned"


S = RunState
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.accepted: frozenset({S.starting, S.cancelling, S.failed}),
    S.starting: frozenset({S.running, S.cancelling, S.failed}),
    S.running: frozenset(
        {S.awaiting_approval, S.paused_capacity, S.cancelling, S.succeeded, S.failed}
    ),
    S.awaiting_approval: frozenset({S.running, S.cancelling, S.failed}),
    S.paused_capacity: frozenset({S.running, S.cancelling, S.failed}),
    S.cancelling: frozenset({S.cancelled, S.failed}),
    S.cancelled: frozenset({S.cleaned}),
    S.succeeded: frozenset({S.cleaned}),
    S.failed: frozenset({S.cleaned}),
    S.cleaned: frozenset(),
}

TERMINAL: frozenset[RunState] = frozenset({S.succeeded, S.failed, S.cancelled})
# States in which the runtime owns live work for the run.
ACTIVE: frozenset[RunState] = frozenset(
    {S.accepted, S.starting, S.running, S.awaiting_approval, S.paused_capacity, S.cancelling}
)


def can_transition(src: RunState | str, dst: RunState | str) -> bool:
    return RunState(dst) in TRANSITIONS[RunState(src)]


def check_transition(src: RunState | str, dst: RunState | str) -> None:
    """Raise ``invalid_state`` unless ``src -> dst`` is in the table."""
    try:
        s, d = RunState(src), RunState(dst)
    except ValueError as e:
        raise ItoError(ErrorCode.invalid_state, f"unknown run state: {e}") from None
    if d not in TRANSITIONS[s]:
        raise ItoError(ErrorCode.invalid_state, f"a run cannot go from {s} to {d}")
