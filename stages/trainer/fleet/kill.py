"""Kill a replica group's processes for real (SIGKILL), for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from stages.trainer.rank.replica import TRAINER_INFIX, TRAINER_PREFIX

# Seconds to wait for an actor's pid when killing it on purpose.
KILL_LOOKUP_TIMEOUT_S = 10.0


def kill_replica_group(
    run_id: str, group: int, *, ranks: list[int] | None = None, namespace: str | None = None
) -> tuple[float, list[int]]:
    """SIGKILL every worker process that is now replica group ``group`` of the run
    (only its ``ranks`` when given), a real crash, for tests and benchmarks; the actors
    must run on this host. Spares that took a group's place are found too. Returns
    (kill time, pids)."""
    return kill_replica_groups(run_id, [group], ranks=ranks, namespace=namespace)


def kill_replica_groups(
    run_id: str,
    groups: list[int],
    *,
    ranks: list[int] | None = None,
    namespace: str | None = None,
) -> tuple[float, list[int]]:
    """``kill_replica_group`` for several groups at the same instant."""
    pids = replica_group_pids(run_id, groups, ranks=ranks, namespace=namespace)
    t = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return t, pids


def replica_group_pids(
    run_id: str,
    groups: list[int] | None = None,
    *,
    ranks: list[int] | None = None,
    namespace: str | None = None,
) -> list[int]:
    """The worker pids of the run's live trainer actors in ``groups`` (all if None),
    only their ``ranks`` when given. A fleet handed on keeps the names of the run that
    made it: every trainer actor is asked which run it now serves."""
    import ray

    names = [
        n
        for n in ray.util.list_named_actors()
        if isinstance(n, str) and n.startswith(TRAINER_PREFIX) and TRAINER_INFIX in n
    ]
    refs: dict[Any, str] = {}
    for name in names:
        with contextlib.suppress(Exception):
            refs[ray.get_actor(name, namespace=namespace).identity.remote()] = name
    # Dead or restarting actors never answer: they are not live members of a group.
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=KILL_LOOKUP_TIMEOUT_S)
    pids: list[int] = []
    for ref in ready:
        try:
            ident = ray.get(ref, timeout=0)
        except Exception:
            continue
        if (
            ident["run_id"] == run_id
            and (groups is None or ident["group"] in groups)
            and (ranks is None or ident["rank"] in ranks)
        ):
            pids.append(int(ident["pid"]))
    return pids
