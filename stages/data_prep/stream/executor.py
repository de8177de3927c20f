"""Run a stage's tasks in this process or as a Ray Data streaming map.

Both executors call the same task functions (``tasks.TASKS``) with the same arguments,
so the outputs are byte-identical; only where the work runs differs. The Ray executor
turns the pending tasks into a Ray Data dataset of one row each and streams them
through ``map_batches`` (one task per batch, ``task_cpus`` each, retried on a lost
worker); Ray Data's streaming executor bounds how many run at once. The results
(small done records) come back as they finish; no document ever passes through the
driver.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from stages.data_prep.stream.config import StreamConfig
from stages.data_prep.stream.store import TaskRecord
from stages.data_prep.stream.tasks import TASKS
from stages.errors import ErrorCode, ItoError


class Executor(Protocol):
    name: str

    def map(self, stage: str, root: str, tasks: list[int]) -> Iterator[TaskRecord]: ...


class LocalExecutor:
    name = "local"

    def map(self, stage: str, root: str, tasks: list[int]) -> Iterator[TaskRecord]:
        fn: Callable[[str, int], TaskRecord] = TASKS[stage]
        for t in tasks:
            yield fn(root, t)


def _apply(batch: dict[str, np.ndarray], stage: str, root: str) -> dict[str, np.ndarray]:
    fn: Callable[[str, int], TaskRecord] = TASKS[stage]
    out = [json.dumps(fn(root, int(t))) for t in batch["task"]]
    return {"record": np.array(out, dtype=object)}


class RayDataExecutor:
    name = "ray"

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg

    def map(self, stage: str, root: str, tasks: list[int]) -> Iterator[TaskRecord]:
        import ray
        import ray.data

        if not ray.is_initialized():
            raise ItoError(ErrorCode.ray_unavailable, "the Ray executor needs ray.init() first")
        if not tasks:
            return
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        items = ray.data.from_items([{"task": t} for t in tasks], override_num_blocks=len(tasks))
        fn: Any = _apply
        # A task lost with its worker or node is retried by Ray Data (its default for
        # tasks); ``stall_timeout_s`` bounds how long the driver waits for progress.
        ds = items.map_batches(
            fn,
            fn_kwargs={"stage": stage, "root": root},
            batch_size=1,
            batch_format="numpy",
            num_cpus=self.cfg.task_cpus,
        )
        results: queue.Queue[tuple[str, Any]] = queue.Queue()

        def consume() -> None:
            try:
                for row in ds.iter_rows():
                    results.put(("record", json.loads(row["record"])))
                results.put(("end", None))
            except BaseException as e:  # surfaced on the caller's thread
                results.put(("error", e))

        threading.Thread(target=consume, name=f"ray-data-{stage}", daemon=True).start()
        for _ in range(len(tasks) + 1):
            try:
                kind, value = results.get(timeout=self.cfg.stall_timeout_s)
            except queue.Empty as e:
                raise ItoError(
                    ErrorCode.stage_failed,
                    f"data prep stage {stage}: no task finished for "
                    f"{self.cfg.stall_timeout_s:.0f} s (stall_timeout_s)",
                ) from e
            if kind == "end":
                return
            if kind == "error":
                cause = value
                while getattr(cause, "cause", None) is not None:
                    cause = cause.cause
                if isinstance(cause, ItoError):
                    raise cause
                raise ItoError(
                    ErrorCode.stage_failed,
                    f"data prep stage {stage} failed on a worker: "
                    f"{type(value).__name__}: {str(value)[:500]}",
                ) from value
            yield value
