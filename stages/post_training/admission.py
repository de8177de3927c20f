"""Which rollout groups may train, in plain Python (the driver's controller uses
these and never imports torch): the staleness bound and DAPO's dynamic-sampling
filter."""

from __future__ import annotations

from collections.abc import Sequence


def is_stale(trainer_version: int, sample_version: int, max_staleness: int) -> bool:
    """The staleness bound: a sample trains only within ``eta`` versions of its policy."""
    return trainer_version - sample_version > max_staleness


def is_uniform(rewards: Sequence[float]) -> bool:
    """A group whose rewards are all equal carries no signal (DAPO drops it)."""
    return max(rewards) - min(rewards) <= 1e-12
