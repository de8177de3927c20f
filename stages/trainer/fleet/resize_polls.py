"""Polling the ranks a resize holds outside the engine's own polls: the ranks of the
groups being added (until they train) and of the groups leaving (until they stopped).

One poll is in flight per rank and none is waited for: each look takes the answers that
came since the last one, so a slow rank never stalls the engine's loop. A rank that asks
for the run's data again (a process Ray restarted) is sent it again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from stages.events import EventPayload
from stages.trainer.fleet.supervision import RankKey
from stages.trainer.rank.rank_state import ENDED_STATES, RankPoll, RankReport, RankState


class ResizePolls:
    """``forward_events(events, group)``: a poll's events go to the run (a drained
    group's last checkpoint is the run's)."""

    def __init__(self, forward_events: Callable[[list[EventPayload], int], None]):
        self.forward_events = forward_events
        self.in_flight: dict[RankKey, Any] = {}  # each polled rank's unanswered poll
        # Each rank's last report here (a group just added may not have answered the
        # engine's own poll yet).
        self.reports: dict[RankKey, RankReport] = {}
        # Each rank's process that was sent the run's data.
        self._data_sent: dict[RankKey, int] = {}
        # When each rank's answer first showed each state (epoch seconds): where a
        # grow's launch spends its time.
        self.seen_at: dict[RankKey, dict[RankState, float]] = {}

    def answers(self, ranks: dict[RankKey, Any]) -> dict[RankKey, RankPoll | None]:
        """The polls of ``ranks`` answered since the last look (None: the rank's process
        is gone)."""
        import ray
        from ray.exceptions import RayActorError

        for key, actor in ranks.items():
            if key not in self.in_flight:
                self.in_flight[key] = actor.poll.remote()
        refs = {self.in_flight[k]: k for k in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        answers: dict[RankKey, RankPoll | None] = {}
        for ref in ready:
            key = refs[ref]
            del self.in_flight[key]
            try:
                reply: RankPoll = ray.get(ref, timeout=0)
            except RayActorError:
                answers[key] = None
                continue
            self.forward_events(reply.events, key[0])
            answers[key] = reply
        return answers

    def all_in(
        self,
        ranks: dict[RankKey, Any],
        states: set[RankState],
        role_shards: dict[str, list[str]] | None,
    ) -> tuple[bool, str]:
        """Whether every rank of ``ranks`` reports one of ``states``, and why one failed
        ("" while none did)."""
        for key, reply in self.answers(ranks).items():
            if reply is None or reply.report.error:
                why = reply.report.error if reply is not None else "its process ended"
                return False, f"rank {key} of a new group failed: {why}"
            report = self.reports[key] = reply.report
            self.seen_at.setdefault(key, {}).setdefault(report.state, time.time())
            if report.state is RankState.awaiting_data and self._data_sent.get(key) != report.pid:
                self._data_sent[key] = report.pid
                ranks[key].command.remote("data", {"role_shards": role_shards})
        done = all((r := self.reports.get(k)) is not None and r.state in states for k in ranks)
        return done, ""

    def ended(self, ranks: dict[RankKey, Any]) -> list[RankKey]:
        """The ranks of ``ranks`` that answered that they stopped, or whose process is
        gone."""
        return [
            key
            for key, reply in self.answers(ranks).items()
            if reply is None or reply.report.state in ENDED_STATES
        ]

    def launch_breakdown(self, ranks: Iterable[RankKey], since: float) -> str:
        """Seconds from ``since`` to the slowest of ``ranks``' process start (its own
        clock) and to its first answer in each state after."""
        keys = [k for k in ranks if k in self.reports]
        if not keys:
            return ""
        parts = [f"process up {max(self.reports[k].started_at for k in keys) - since:.2f}s"]
        for state in (RankState.awaiting_data, RankState.ready):
            seen = [self.seen_at[k][state] for k in keys if state in self.seen_at.get(k, {})]
            if seen:
                parts.append(f"{state} seen {max(seen) - since:.2f}s")
        return ", ".join(parts)

    def forget(self, key: RankKey) -> None:
        """Rank ``key`` is no longer polled here (its unanswered poll is dropped)."""
        self.in_flight.pop(key, None)
        self.seen_at.pop(key, None)
