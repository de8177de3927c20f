"""The engine asks each rank for its events at most once per ``poll_interval_s``,
however fast the rank answers: a poll answered at once must not be re-sent at once
(each poll costs the rank's training loop the GIL for the call).

Real Ray actors stand in for the ranks: they answer every poll at once and count them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from stages.trainer.config import TrainStageConfig
from stages.trainer.engine import TrainingEngine

POLL_INTERVAL_S = 0.05
POLL_CALLS = 40


def _cfg(tmp: Path) -> TrainStageConfig:
    return TrainStageConfig.model_validate(
        dict(
            model={"preset": "llama-tiny", "size": "0.1M"},
            target={"max_steps": 10, "seq_len": 32, "global_batch_tokens": 256},
            checkpoint={"interval_steps": 5, "storage_uri": f"file://{tmp}/ckpt"},
            replica_groups=2,
            fault_tolerance={"poll_interval_s": POLL_INTERVAL_S},
        ),
        strict=False,
    )


def test_each_rank_is_polled_at_most_once_per_poll_interval(
    ray_local: None, tmp_path: Path
) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, pid: int) -> None:
            self.pid, self.polls = pid, 0

        def poll(self) -> dict[str, Any]:
            self.polls += 1
            status = {"phase": "training", "pid": self.pid, "step": 0, "started_at": 0.0}
            return {"events": [], "status": status}

        def count(self) -> int:
            return self.polls

    engine = TrainingEngine(
        _cfg(tmp_path),
        run_id="pollpace",
        checkpoint_dir=tmp_path / "ckpt",
        role_shards=None,
        emit=lambda _e: None,
        cancel_event=threading.Event(),
        wait_decision=lambda _p, _t: None,
    )
    ranks = [Rank.remote(1000 + g) for g in range(2)]  # type: ignore[attr-defined]
    engine.actors = {(g, 0): r for g, r in enumerate(ranks)}
    started = time.monotonic()
    for _ in range(POLL_CALLS):
        engine.poll_once(POLL_INTERVAL_S)
    elapsed = time.monotonic() - started
    counts = ray.get([r.count.remote() for r in ranks])
    # A rate bound, not a speed claim: a slower host only makes it easier to meet.
    bound = elapsed / POLL_INTERVAL_S + 1
    assert all(1 <= c <= bound for c in counts), (counts, bound)
    for r in ranks:
        ray.kill(r)
