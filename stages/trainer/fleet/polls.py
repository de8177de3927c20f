"""The engine's polls of its ranks and standbys: one schedule, and each rank's poll in
flight.

An actor (a rank by its key, a standby by its name) is asked at most once per
``poll_interval_s``, however fast it answers, and a rank has at most one poll in
flight. ``send_and_wait`` asks every rank whose turn it is (and the standbys, through
their pool), then waits for the answers; ``answers`` hands them out one by one, each
checked at its turn against the rank's poll in flight: a poll of an actor replaced
meanwhile (a standby took over while an earlier answer was handled) is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stages.trainer.fleet.supervision import RankKey
from stages.trainer.rank.rank_state import RankPoll

if TYPE_CHECKING:
    from ray import ObjectRef

    from stages.trainer.fleet.standby import StandbyPool


class RankPolls:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        # When each rank or standby (by key or name) is next polled.
        self.due_at: dict[RankKey | str, float] = {}
        self.in_flight: dict[RankKey, ObjectRef[RankPoll]] = {}

    def due(self, key: RankKey | str, now: float) -> bool:
        """Whether ``key``'s next poll is due (and, if so, when the one after is)."""
        if now < self.due_at.get(key, 0.0):
            return False
        self.due_at[key] = now + self.interval_s
        return True

    def sooner(self, key: RankKey, in_s: float) -> None:
        """Poll rank ``key`` within ``in_s`` (if not already due sooner)."""
        due = time.monotonic() + in_s
        self.due_at[key] = min(self.due_at.get(key, due), due)

    def forget(self, key: RankKey) -> ObjectRef[RankPoll] | None:
        """Stop polling rank ``key``; returns its poll in flight (None: none)."""
        self.due_at.pop(key, None)
        return self.in_flight.pop(key, None)

    def send_and_wait(
        self, actors: dict[RankKey, Any], standby: StandbyPool, timeout_s: float
    ) -> dict[ObjectRef[RankPoll], RankKey]:
        """Ask every rank whose turn it is, and wait up to ``timeout_s`` for the
        answers; returns those ready, with their rank."""
        import ray

        started = time.monotonic()
        for key, actor in actors.items():
            if key not in self.in_flight and self.due(key, started):
                self.in_flight[key] = actor.poll.remote()
        standby.poll()
        refs = {ref: key for key, ref in self.in_flight.items()}
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
            return {ref: refs[ref] for ref in ready}
        # Every rank answered its last poll: wait for the next one's turn. Only an
        # actor with no poll in flight has a turn coming (one in flight is checked each
        # pass): a standby still warming up, its poll unanswered for seconds, must not
        # turn this into a busy loop beside the ranks.
        idle: list[RankKey | str] = [k for k in actors if k not in self.in_flight]
        idle += standby.idle()
        next_due = min((self.due_at.get(k, started) for k in idle), default=started + timeout_s)
        time.sleep(max(0.0, min(timeout_s, next_due - started)))
        return {}

    def answers(
        self, ready: dict[ObjectRef[RankPoll], RankKey]
    ) -> Iterator[tuple[RankKey, RankPoll | Exception]]:
        """Each ready poll's rank and its answer, or the error its actor died with;
        checked one at a time, as the caller handles the one before."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for ref, key in ready.items():
            if self.in_flight.get(key) is not ref:
                continue  # a poll of an actor replaced meanwhile (a standby took over)
            del self.in_flight[key]
            try:
                reply: RankPoll = ray.get(ref, timeout=0)
            except (RayActorError, GetTimeoutError) as e:
                yield key, e
                continue
            yield key, reply
