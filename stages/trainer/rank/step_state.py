"""What a step is, and what of the loop a resume or a heal carries: the data batch a
step trains (past the skipped windows), one step's outcome, and the loop's own state."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from stages.trainer.rank.membership import Membership

Window = tuple[int, int]


class LoopHolder(Protocol):
    """What ``LoopState`` reads and writes of the loop."""

    windows: list[Window]
    membership: Membership
    manager: Any


def data_index(step: int, windows: list[Window]) -> int:
    """The data batch a phase's step trains on, given the skipped ``[start, end)``
    windows (batch indices). A window is only ever added at or after the batch of the
    step it restarts from, so the batches of earlier steps never change."""
    idx = step
    for start, end in sorted(windows):
        if idx >= start:
            idx += end - start
    return idx


@dataclass
class StepResult:
    """One attempt at optimizer step ``step`` (0-based: it makes step ``step + 1``)."""

    step: int
    committed: bool
    loss: float
    grad_norm: float
    lr: float
    batch: int
    quorum: int
    seconds: float
    ended_at: float
    # Some group voted to hold at this step's end (a resize): every group does.
    hold: bool = False

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class LoopState:
    """The loop's own resumable state: skipped data windows, torchft's batch count, the
    groups that share each step's batch."""

    def __init__(self, loop: LoopHolder):
        self.loop = loop
        self.batches_committed = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "windows": [list(w) for w in self.loop.windows],
            "batches_committed": self.loop.manager.batches_committed(),
            "membership": self.loop.membership.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.windows = [(int(a), int(b)) for a, b in state["windows"]]
        self.batches_committed = int(state["batches_committed"])
        if "membership" in state:  # a checkpoint of a run that never resized has none
            self.loop.membership.load_state_dict(state["membership"])
