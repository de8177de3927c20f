"""The ladder probe's proxies as Ray tasks on the run's booked nodes, so the driver
(which only coordinates) never builds or trains a model.

The tasks run in the run's placement group (``stages.placement``), all submitted at
once: on CUDA one task per arm and seed, each on its own GPU; on CPU one task trains
every proxy in turn (``task_buckets``). Each task yields a proxy's score as soon as
it is trained, so the stage logs it while the others train. The tasks reserve no CPU
of the group: the trainer fleet is placed and warming while data prep runs
(``StartEarly``) and holds the bundles' CPUs, and a probe waiting behind the fleet it
precedes would never start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from stages.data_prep.config import LadderProbeConfig
from stages.data_prep.ladder import ArmJob, ArmRunner
from stages.errors import ErrorCode, ItoError
from stages.placement import actor_options

# One proxy's bound (the testbed's take seconds; a GPU rung minutes). A task that
# cannot be placed or hangs fails the probe (the stage logs it as skipped).
ARM_TIMEOUT_S = 1800.0
# How often the driver checks for a cancel between finished tasks.
WAIT_S = 0.5


def _score_arms(
    jobs: list[ArmJob], arms: list[str], windows: np.ndarray, cfg: LadderProbeConfig, *streams: Any
) -> Iterator[tuple[float, str]]:
    """The task: trains and scores ``jobs`` one after another, yielding each proxy's
    (bpb, device) as it finishes. It imports the proxy's torch side in the task's
    process only (a remote function is pickled by reference, so the driver never
    imports it); ``streams[i]`` is ``arms[i]``'s token stream."""
    from stages.data_prep.ladder_arm import score_arm

    by_arm = dict(zip(arms, streams, strict=True))
    for job in jobs:
        yield score_arm(job, by_arm[job.arm], windows, cfg)


def task_buckets(jobs: list[ArmJob], cfg: LadderProbeConfig) -> list[list[ArmJob]]:
    """The proxies each task trains in turn. A CUDA probe gives every proxy a task and a
    GPU of its own, all at once; on CPU the host is one device, and one process trains
    them all (imports and model build paid once, not per proxy)."""
    if not jobs:
        return []
    return [[j] for j in jobs] if cfg.device == "cuda" else [list(jobs)]


def ray_runner(facts: Mapping[str, Any], cancelled: Callable[[], bool]) -> ArmRunner:
    def run(
        jobs: list[ArmJob],
        streams: dict[str, np.ndarray],
        windows: np.ndarray,
        cfg: LadderProbeConfig,
    ) -> Iterator[tuple[ArmJob, float, str]]:
        import ray

        task = ray.remote(_score_arms).options(
            num_cpus=0,
            num_gpus=1 if cfg.device == "cuda" else 0,
            max_retries=0,
            **actor_options(facts, bundle_index=0),
        )
        # Each stream and the eval windows go to the object store once, not per task.
        stream_refs = {arm: ray.put(s) for arm, s in streams.items()}
        windows_ref = ray.put(windows)
        # Each task's generator -> its jobs not yet reported, in the order it runs them.
        pending: dict[Any, list[ArmJob]] = {}
        for bucket in task_buckets(jobs, cfg):
            arms = sorted({j.arm for j in bucket})
            refs = [stream_refs[a] for a in arms]
            pending[task.remote(bucket, arms, windows_ref, cfg, *refs)] = list(bucket)
        deadline = time.monotonic() + ARM_TIMEOUT_S * max(1, len(jobs))
        try:
            while pending:
                if cancelled():
                    raise InterruptedError("ladder probe cancelled")
                if time.monotonic() > deadline:
                    left = sum(len(b) for b in pending.values())
                    raise ItoError(
                        ErrorCode.stage_failed,
                        f"ladder probe: {left} proxies unfinished after "
                        f"{ARM_TIMEOUT_S * len(jobs):.0f}s",
                    )
                done, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S)
                for gen in done:
                    try:
                        ref = next(gen)  # type: ignore[arg-type]  # an ObjectRefGenerator
                    except StopIteration:
                        del pending[gen]
                        continue
                    bpb, device = ray.get(ref)
                    yield pending[gen].pop(0), float(bpb), str(device)
        finally:
            for gen in pending:
                ray.cancel(gen, force=True)

    return run
