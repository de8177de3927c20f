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
from typing import Any

from stages.events import LogEvent

# Steps of one group, phase and commit state merged into one event at most; and of
# one batch share: a resize re-cuts it, and the run's token ledger reads it per step.
_MERGEABLE_KEYS = ("replica_group", "phase", "committed", "quorum_size", "stage", "batch_share")


def _mergeable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.get("kind") == b.get("kind") == "step"
        and bool(a.get("committed"))
        and all(a.get(k) == b.get(k) for k in _MERGEABLE_KEYS)
        and int(b.get("first_step") or b["step"]) == int(a["step"]) + 1
    )


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(b)
    out["first_step"] = int(a.get("first_step") or a["step"])
    out["tokens"] = int(a["tokens"]) + int(b["tokens"])
    out["seconds"] = float(a["seconds"]) + float(b["seconds"])
    return out


FOLDED = "log line(s) folded while the event consumer lagged"


def coalesce(events: Iterable[dict[str, Any]], folded: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Merge runs of consecutive committed steps; fold log lines into one count.
    ``folded``: log lines folded before (an earlier summary line carries them).
    Returns the events and the new total of folded log lines."""
    out: list[dict[str, Any]] = []
    last_step: dict[tuple[Any, ...], int] = {}  # index in out of each group's last step
    first_log: dict[str, Any] | None = None
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
            ts=first_log["ts"],
            stage=first_log.get("stage", ""),
        )
        extra = {"seq": first_log["seq"]} if "seq" in first_log else {}
        out.insert(0, {**summary.model_dump(mode="json"), **extra})
    return out, folded


def expand_steps(ev: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The per-step events a merged step event stands for (tokens and seconds split
    evenly, each step ending ``seconds / n`` before the next, the last at the merged
    event's ``ts``); an unmerged one as is."""
    first = ev.get("first_step")
    if first is None or int(first) == int(ev["step"]):
        yield ev
        return
    last = int(ev["step"])
    n = last - int(first) + 1
    each = float(ev["seconds"]) / n
    for s in range(int(first), last + 1):
        one = {**ev, "step": s, "first_step": None, "tokens": int(ev["tokens"]) // n}
        one["seconds"] = each
        if "ts" in ev:
            one["ts"] = float(ev["ts"]) - (last - s) * each
        yield one


class EventBuffer:
    """FIFO of event dicts; beyond ``max_events`` the older half is coalesced."""

    def __init__(self, max_events: int):
        self.max_events = max_events
        self.items: deque[dict[str, Any]] = deque()
        self.logs_folded = 0
        self._compact_at = max_events

    def __len__(self) -> int:
        return len(self.items)

    def append(self, payload: dict[str, Any]) -> None:
        self.items.append(payload)
        if len(self.items) > self._compact_at:
            # The whole buffer in one pass; what cannot merge (rare kinds) may grow it,
            # then the next pass waits until it doubled: amortised O(1) per event.
            merged, self.logs_folded = coalesce(self.items, self.logs_folded)
            self.items = deque(merged)
            self._compact_at = max(self.max_events, 2 * len(self.items))

    def drain(self) -> list[dict[str, Any]]:
        out, self.items = list(self.items), deque()
        self._compact_at = self.max_events
        return out
