"""When a rank saves the run's checkpoint, and what it reports of the saves.

One replica group saves: the lowest live replica id, torchft's participating rank 0.
Every rank of that group takes part (DCP's save is a collective over the group). A save
is async (``Checkpointer``): it blocks only for the state copy, and is reported (a
``CheckpointEvent`` and a ``checkpoint_blocking`` badput span) once it is complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stages.curriculum.schedule import CurriculumSchedule
from stages.events import CheckpointEvent, Event, PhaseEvent

if TYPE_CHECKING:
    from stages.checkpointing.checkpointer import Checkpointer
    from stages.trainer.rank.train_state import TrainState


class RankSaver:
    def __init__(
        self,
        ckpt: Checkpointer,
        manager: Any,  # torchft Manager
        train_state: TrainState,
        schedule: CurriculumSchedule,
        emit: Callable[[Event], None],
        *,
        sharded: bool,
    ):
        self.ckpt = ckpt
        self.manager = manager
        self.train_state = train_state
        self.schedule = schedule
        self.emit = emit
        self.sharded = sharded
        self._last_saved = -1
        self._save_started: dict[int, float] = {}

    def is_saver(self) -> bool:
        return bool(self.manager.participating_rank() == 0)  # torchft

    def report(self) -> None:
        """Report the saves completed since the last look."""
        for rec in self.ckpt.poll():
            self.emit(
                CheckpointEvent(
                    step=rec.step,
                    path=rec.path,
                    bytes=rec.bytes,
                    blocking_s=rec.blocking_s,
                    total_s=rec.total_s,
                    phase=self.schedule.phase_of(max(0, rec.step - 1)).name,
                )
            )
            # Blocking includes any wait for the state copy in the next optimizer
            # step, so the badput span is the record's, not save()'s own duration.
            t0 = self._save_started.pop(rec.step, time.time())
            self.emit(PhaseEvent(phase="checkpoint_blocking", start=t0, end=t0 + rec.blocking_s))

    def _due(self, step: int) -> bool:
        due = bool(self.ckpt.due(step))
        if self.sharded:
            # A time-based policy may differ by a tick between ranks; DCP's save is a
            # collective, so the group saves if any rank says so.
            import torch.distributed as dist

            flag = torch.tensor([int(due)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def save(self, step: int, *, force: bool = False) -> None:
        """Save the state after step ``step`` if this group saves and the policy says
        so (``force``: whatever it says), once."""
        self.report()
        if not self.is_saver() or not (force or self._due(step)):
            return
        if step == self._last_saved or any(r.step == step for r in self.ckpt.records()):
            return
        self._last_saved = step
        self._save_started[step] = time.time()
        self.train_state.step = step
        # Async: blocks only for the state copy. Sealed with the phase its last step is in.
        phase = self.schedule.phase_of(max(step - 1, 0)).name
        self.ckpt.save(step, self.train_state, phase=phase)
