"""The ladder probe's proxies as Ray tasks on the run's booked nodes, so the driver
(which only coordinates) never builds or trains a model.

Each arm and seed is one task in the run's placement group (``stages.placement``),
all submitted at once; results are yielded as they finish, so the stage logs each
proxy's score while the others train. The tasks reserve no CPU of the group: the
trainer fleet is placed and warming while data prep runs (``StartEarly``) and holds
the bundles' CPUs, and a probe waiting behind the fleet it precedes would never start.
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


def _score_arm(
    job: ArmJob, stream: np.ndarray, windows: np.ndarray, cfg: LadderProbeConfig
) -> tuple[float, str]:
    """The task: imports the proxy's torch side in the task's process only (a remote
    function is pickled by reference, so the driver never imports it)."""
    from stages.data_prep.ladder_arm import score_arm

    return score_arm(job, stream, windows, cfg)


def ray_runner(facts: Mapping[str, Any], cancelled: Callable[[], bool]) -> ArmRunner:
    def run(
        jobs: list[ArmJob],
        streams: dict[str, np.ndarray],
        windows: np.ndarray,
        cfg: LadderProbeConfig,
    ) -> Iterator[tuple[ArmJob, float, str]]:
        import ray

        task = ray.remote(_score_arm).options(
            num_cpus=0,
            num_gpus=1 if cfg.device == "cuda" else 0,
            max_retries=0,
            **actor_options(facts, bundle_index=0),
        )
        # Each stream and the eval windows go to the object store once, not per task.
        stream_refs = {arm: ray.put(s) for arm, s in streams.items()}
        windows_ref = ray.put(windows)
        pending = {task.remote(j, stream_refs[j.arm], windows_ref, cfg): j for j in jobs}
        deadline = time.monotonic() + ARM_TIMEOUT_S * max(1, len(jobs))
        try:
            while pending:
                if cancelled():
                    raise InterruptedError("ladder probe cancelled")
                if time.monotonic() > deadline:
                    raise ItoError(
                        ErrorCode.stage_failed,
                        f"ladder probe: {len(pending)} proxies unfinished after "
                        f"{ARM_TIMEOUT_S * len(jobs):.0f}s",
                    )
                done, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S)
                for ref in done:
                    job = pending.pop(ref)
                    bpb, device = ray.get(ref)
                    yield job, float(bpb), str(device)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)

    return run
