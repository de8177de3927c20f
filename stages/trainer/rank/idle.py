"""Work a rank does ahead of need, at the priority of an idle core.

A standby's model build and warm-up and a live rank's phase-end imports are worth
doing early, but not at the price of a training step: on a node whose cores are all
given to ranks, they ran at normal priority on the live ranks' cores and slowed their
steps for as long as they lasted (the first tens of steps of a run, and the first
seconds after every standby is started). Linux's ``SCHED_IDLE`` runs a thread only when
its core would otherwise idle (a rank waiting on a collective or the quorum).

The policy is set on a thread of its own, which ends with the work: an unprivileged
thread cannot go back from ``SCHED_IDLE`` to normal priority, so the rank's own threads
never take it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def lower_to_idle() -> bool:
    """Put the calling thread (Linux schedules threads, not processes) at ``SCHED_IDLE``.
    False where the platform has no such policy; the work then runs at the thread's
    priority."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        return False
    return True


def idle_thread(target: Callable[[], object], *, name: str) -> threading.Thread:
    """A started daemon thread that runs ``target`` at idle priority."""

    def run() -> None:
        lower_to_idle()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def run_when_idle(target: Callable[[], object], *, name: str) -> None:
    """Run ``target`` at idle priority and wait for it; its exception is raised here."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    idle_thread(run, name=name).join()
    if failure:
        raise failure[0]
