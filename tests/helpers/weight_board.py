"""Stand in for the driver's side of the weight board in engine tests that run the
grpo objective without a rollout fleet: take every version the ranks publish, in
order, as the driver's learner does, and keep the last one's tensors."""

from __future__ import annotations

import threading
import uuid
from typing import Any

# Bound on waiting for one version (a step on a loaded 2-core host, a group heal).
TAKE_TIMEOUT_S = 300.0


class BoardTaker:
    """A real ``WeightBoard`` and a thread that takes versions ``1..last``, fetches
    the last one's state (this test process, not a driver, holds it) and releases it."""

    def __init__(self, last: int):
        from stages.post_training.weight_board import board_name, start_board

        self.name = board_name("test", uuid.uuid4().hex[:8])
        self.board = start_board(self.name, 1)
        self.last = last
        self.taken: list[int] = []
        self.state: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="board-taker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        from stages.post_training.weight_board import take

        try:
            for v in range(1, self.last + 1):
                published = take(self.board, v, TAKE_TIMEOUT_S, lambda: False)
                self.taken.append(v)
                if v == self.last:
                    self.state = ray.get(published.weights.ref, timeout=TAKE_TIMEOUT_S)
                    ray.get(self.board.release.remote(v), timeout=TAKE_TIMEOUT_S)
        except BaseException as e:  # surfaced by join()
            self.error = e

    def join(self) -> dict[str, Any]:
        import ray

        self._thread.join(TAKE_TIMEOUT_S)
        ray.kill(self.board, no_restart=True)
        if self.error is not None:
            raise self.error
        assert self.state is not None, f"versions taken: {self.taken[-3:]}"
        return self.state


def sync_only_controller(pool: Any, timeout_s: float) -> Any:
    """A ``RolloutController`` that only moves weights: no requests are made (its
    maker is never called), one group a step, no staleness, no dynamic sampling."""
    from stages.post_training.fleet import DynamicSampler, RolloutController

    return RolloutController(
        pool,
        lambda k, s: None,  # type: ignore[arg-type, return-value]
        groups_per_step=1,
        max_staleness=0,
        sampler=DynamicSampler(False, 0),
        rollout_timeout_s=timeout_s,
        restart_timeout_s=timeout_s,
    )
