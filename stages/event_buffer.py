"""A bounded buffer of serialised events that aggregates instead of dropping.

Between ranks, engine and driver, events wait in memory until the next poll. When a
consumer stalls, the buffer stays bounded without losing what goodput and recovery
accounting are computed from: a run of committed steps of one replica group in one
phase becomes one step event covering ``first_step..step`` (tokens and seconds
summed), and log lines become one count. Phase, interruption, checkpoint, proposal
and eval events are never merged or dropped (they are few).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from pydantic import JsonValue

from stages.events import EventPayload, LogEvent

# Steps of one group, phase and commit state merged into one event at most; and of
# one batch share: a resize re-cuts it, and the run's token ledger reads it per step.
_MERGEABLE_KEYS = ("replica_group", "phase", "committed", "quorum_size", "stage", "batch_share")


def as_int(value: JsonValue) -> int:
    """A payload's number (or numeric string) as ``int()`` reads it; anything else raises."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"not a number: {value!r}")


def as_float(value: JsonValue) -> float:
    """A payload's number (or numeric string) as ``float()`` reads it; anything else raises."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"not a number: {value!r}")


def _mergeable(a: EventPayload, b: EventPayload) -> bool:
    return (
        a.get("kind") == b.get("kind") == "step"
        and bool(a.get("committed"))
        and all(a.get(k) == b.get(k) for k in _MERGEABLE_KEYS)
        and as_int(b.get("first_step") or b["step"]) == as_int(a["step"]) + 1
    )


def _merge(a: EventPayload, b: EventPayload) -> EventPayload:
    out = dict(b)
    out["first_step"] = as_int(a.get("first_step") or a["step"])
    out["tokens"] = as_int(a["tokens"]) + as_int(b["tokens"])
    out["seconds"] = as_float(a["seconds"]) + as_float(b["seconds"])
    return out


FOLDED = "log line(s) folded while the event consumer lagged"


def coalesce(events: Iterable[EventPayload], folded: int = 0) -> tuple[list[EventPayload], int]:
    """Merge runs of consecutive committed steps; fold log lines into one count.
    ``folded``: log lines folded before (an earlier summary line carries them).
    Returns the events and the new total of folded log lines."""
    out: list[EventPayload] = []
    last_step: dict[tuple[object, ...], int] = {}  # index in out of each group's last step
    first_log: EventPayload | None = None
    for ev in events:
        if ev.get("kind") == "log":
            first_log = first_log or ev
            if not str(ev.get("message", "")).endswith(FOLDED):
                folded += 1
            continue
        if ev.get("kind") == "step":
            # A share is a list once serialised: a tuple, to be part of the key.
            key = tuple(
                tuple(v) if isinstance(v := ev.get(k), list) else v for k in _MERGEABLE_KEYS
            )
            i = last_step.get(key)
            if i is not None and _mergeable(out[i], ev):
                out[i] = _merge(out[i], ev)
                continue
            last_step[key] = len(out)
        else:
            last_step.clear()  # never merge steps across another kind of event
        out.append(ev)
    if first_log is not None:
        summary = LogEvent(
            level="warning",
            message=f"{folded} {FOLDED}",
            ts=as_float(first_log["ts"]),
            stage=str(first_log.get("stage", "")),
        )
        extra = {"seq": first_log["seq"]} if "seq" in first_log else {}
        out.insert(0, {**summary.model_dump(mode="json"), **extra})
    return out, folded


def expand_steps(ev: EventPayload) -> Iterator[EventPayload]:
    """The per-step events a merged step event stands for (tokens and seconds split
    evenly, each step ending ``seconds / n`` before the next, the last at the merged
    event's ``ts``); an unmerged one as is."""
    first = ev.get("first_step")
    if first is None or as_int(first) == as_int(ev["step"]):
        yield ev
        return
    last = as_int(ev["step"])
    n = last - as_int(first) + 1
    each = as_float(ev["seconds"]) / n
    for s in range(as_int(first), last + 1):
        one: EventPayload = {**ev, "step": s, "first_step": None}
        one["tokens"] = as_int(ev["tokens"]) // n
        one["seconds"] = each
        if "ts" in ev:
            one["ts"] = as_float(ev["ts"]) - (last - s) * each
        yield one


class EventBuffer:
    """FIFO of event dicts; beyond ``max_events`` the older half is coalesced."""

    def __init__(self, max_events: int):
        self.max_events = max_events
        self.items: deque[EventPayload] = deque()
        self.logs_folded = 0
        self._compact_at = max_events

    def __len__(self) -> int:
        return len(self.items)

    def append(self, payload: EventPayload) -> None:
        self.items.append(payload)
        if len(self.items) > self._compact_at:
            # The whole buffer in one pass; what cannot merge (rare kinds) may grow it,
            # then the next pass waits until it doubled: amortised O(1) per event.
            merged, self.logs_folded = coalesce(self.items, self.logs_folded)
            self.items = deque(merged)
            self._compact_at = max(self.max_events, 2 * len(self.items))

    def drain(self) -> list[EventPayload]:
        out, self.items = list(self.items), deque()
        self._compact_at = self.max_events
        return out
