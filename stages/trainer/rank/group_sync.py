"""The replica groups' sync as the rank loop sees it: one of two classes, chosen by
``TrainStageConfig.sync`` when the rank joins its group (``rank/setup.py``).

``EveryStepSync`` (``rank/every_step.py``): torchft's fault-tolerant DDP, the gradients
of every step averaged over the groups. ``DiLoCoSync`` (``rank/diloco.py``): torchft's
DiLoCo, inner steps alone and a sync of the pseudo-gradients every turn. The loop asks a
step of it, the run's step, and the few things that differ around a resume; what a step
needs of the loop is ``StepHost``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from stages.curriculum.schedule import PhaseSpan
from stages.events import Event
from stages.trainer.config import TrainStageConfig
from stages.trainer.rank.control import Control, WorkerSpec
from stages.trainer.rank.membership import Membership
from stages.trainer.rank.objective import Batch, Objective
from stages.trainer.rank.rank_state import RankStatus
from stages.trainer.rank.step_state import StepResult, Window

if TYPE_CHECKING:
    from stages.trainer.parallel.parallelize import ParallelModel


class StepHost(Protocol):
    """What a sync's step needs of the rank's loop (``stages.trainer.rank.loop``)."""

    spec: WorkerSpec
    cfg: TrainStageConfig
    control: Control
    phase: PhaseSpan
    windows: list[Window]
    membership: Membership
    parallel: ParallelModel
    objective: Objective
    status: RankStatus

    def cut(self, step: int) -> tuple[int, int] | None: ...
    def next_batch(self, batch: int) -> Batch: ...
    def share_tokens(self, step: int, read: int) -> int: ...
    def refuse_if_members_missing(self, step: int) -> None: ...
    def emit(self, event: Event) -> None: ...
    def pace(self, t0: float, quorum: int, step: int) -> None: ...
    def after_heal(self, trained: int) -> bool: ...


class GroupSync(Protocol):
    def train_step(self, loop: StepHost, step: int) -> StepResult:
        """One step of this group on step ``step``'s batch, with the groups' sync."""
        ...

    def current_step(self) -> int:
        """The run's step (the next one to train)."""
        ...

    def manager_step(self, step: int) -> int:
        """torchft's step count at run step ``step`` (a resume sets it)."""
        ...

    def loading(self) -> AbstractContextManager[None]:
        """Around a checkpoint's load."""
        ...

    @property
    def mid_turn(self) -> bool:
        """Whether the groups' weights differ now (no checkpoint is taken then)."""
        ...

    def join_running_run(
        self, peer_steps: Callable[[], list[int]], stopped: Callable[[], bool]
    ) -> None:
        """A restarted group's first move, before its first step."""
        ...

    def close(self) -> None: ...
