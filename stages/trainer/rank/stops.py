"""Where the rank loop stops after a committed step and waits for the driver.

A loss spike (or a refused non-finite step) pauses the group until the human's
decision comes back: resume, or restore a checkpoint and skip the data batches that
spiked. A resize holds every group at the step they agreed on until the driver sends
the new members, or this group's stop. The loop (``stages.trainer.rank.loop``) calls
these at step boundaries; what they need of it is ``StopHost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from stages.curriculum.schedule import PhaseSpan
from stages.trainer.rank.control import Control
from stages.trainer.rank.loss_spike import LossSpikeDetector, ReportedSpike
from stages.trainer.rank.membership import Membership
from stages.trainer.rank.rank_state import RankState, RankStatus
from stages.trainer.rank.shard_state import param_digest
from stages.trainer.rank.step_state import Window, data_index

if TYPE_CHECKING:
    import torch

    from stages.checkpointing.checkpointer import Checkpointer


class StopHost(Protocol):
    """What a stop needs of the rank's loop."""

    control: Control
    status: RankStatus
    detector: LossSpikeDetector
    membership: Membership
    phase: PhaseSpan
    windows: list[Window]
    model: torch.nn.Module

    @property
    def checkpointer(self) -> Checkpointer: ...
    def log(
        self, message: str, level: Literal["debug", "info", "warning", "error"] = "info"
    ) -> None: ...
    def restore(self, step: int) -> None: ...
    def restored(self, step: int, skipped: tuple[int, int] | None = None) -> None: ...
    def is_saver_at_end(self) -> bool: ...


def spiked(loop: StopHost, step: int, loss: float, batch_idx: int) -> bool:
    """Whether ``loss`` at ``step`` is a spike; one is reported with its batch and the
    skipped data windows (the driver proposes the restore from them)."""
    spike = loop.detector.observe(step, loss)
    if spike is None:
        return False
    loop.status.update(
        spike=ReportedSpike(**spike.model_dump(), batch=batch_idx, windows=list(loop.windows))
    )
    return True


def pause(loop: StopHost, step: int, *, refused_batch: int | None = None) -> None:
    """Stop at a committed step until the driver relays the human's decision.
    ``refused_batch``: a non-finite step was refused; declined, its batch is
    skipped (retrying it would refuse it again)."""
    loop.checkpointer.wait()
    loop.status.enter(RankState.paused, paused_at=step, digest=param_digest(loop.model))
    loop.log(f"paused at step {step}: loss spike, awaiting approval")
    kind, params = loop.control.wait_command()
    loop.status.enter(RankState.training, paused_at=None, spike=None)
    if kind == "restore":
        step = int(params["step"])
        loop.restore(step)
        # Skip the next ``skip_batches`` batches from the checkpoint's data position.
        start = data_index(step - loop.phase.start_step, loop.windows)
        window = (start, start + int(params["skip_batches"]))
        loop.windows = sorted({*loop.windows, window})
        if loop.is_saver_at_end():
            loop.checkpointer.discard_after(step)  # the abandoned timeline is never resumed
        loop.restored(step, window)
    elif kind == "resume" and refused_batch is not None:
        loop.windows = sorted({*loop.windows, (refused_batch, refused_batch + 1)})
        loop.log(f"skipping data batch {refused_batch}: its step was not finite")


def hold(loop: StopHost, step: int) -> None:
    """Every group stopped after step ``step`` (one voted: ``Control.hold``): wait for
    the driver's new members, or for this group's own stop (it leaves the run)."""
    loop.control.hold = False
    loop.checkpointer.wait()  # a save in flight ends before the groups change
    loop.status.enter(RankState.held, held_at=step)
    kind, params = loop.control.wait_command()
    if kind == "stop":
        return  # drained (and saved, pausing for capacity): the loop ends (``_finish``)
    if kind == "members":
        loop.membership.change(int(params["first_step"]), tuple(params["members"]))
        loop.log(f"from step {params['first_step']} the batch is shared by {params['members']}")
    loop.status.enter(RankState.training, held_at=None)
