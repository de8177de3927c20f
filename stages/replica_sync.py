"""How replica groups keep their weights together: every step, or DiLoCo.

``every_step``: the groups allreduce their gradients each step (torchft's fault-tolerant
DDP). ``diloco``: each group takes ``sync_every`` inner optimizer steps on its own data,
then the groups allreduce the pseudo-gradient (the weights at the last sync minus their
own) and an outer Nesterov-SGD step moves the shared weights (torchft's ``DiLoCo``;
Douillard et al. 2023). With ``fragments`` > 1 the model is split into that many
fragments synced in turn, one every ``sync_every // fragments`` inner steps (streaming
DiLoCo; Douillard et al. 2025): each sync moves a fragment's bytes, not the model's.

The planner chooses the mode from the booking's fabric (``stages.parallelism``); a
manifest may pin it. The trainer runs what it is given. This module is the whole
contract between the two.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.base import StrictModel
from stages.errors import ErrorCode, ItoError

SyncMode = Literal["every_step", "diloco"]


class ReplicaSync(StrictModel):
    """The replica groups' synchronisation (``every_step`` unless planned otherwise)."""

    mode: SyncMode = "every_step"
    # Inner steps between two syncs of the whole model (H); 1 with every_step.
    sync_every: int = Field(default=1, ge=1, le=100_000)
    # Streaming DiLoCo: fragments of the model synced in turn (1: the whole model at once).
    fragments: int = Field(default=1, ge=1, le=64)
    # The outer optimizer: Nesterov SGD, the DiLoCo paper's (lr 0.7, momentum 0.9).
    outer_lr: float = Field(default=0.7, gt=0, le=10, allow_inf_nan=False)
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _coherent(self) -> ReplicaSync:
        # Raised as is (pydantic passes non-ValueErrors through): a stable code.
        if self.mode == "every_step" and (self.sync_every != 1 or self.fragments != 1):
            raise ItoError(
                ErrorCode.plan_sync_invalid,
                f"sync every_step takes no sync_every ({self.sync_every}) or fragments "
                f"({self.fragments}); pin diloco to sync every H steps",
            )
        if self.mode == "diloco":
            if self.sync_every < 2:
                raise ItoError(
                    ErrorCode.plan_sync_invalid,
                    f"diloco syncs every H >= 2 inner steps (got {self.sync_every}); "
                    "H = 1 is every_step",
                )
            if self.sync_every % self.fragments:
                raise ItoError(
                    ErrorCode.plan_sync_invalid,
                    f"diloco's {self.fragments} fragments do not split sync_every "
                    f"{self.sync_every} into equal turns",
                )
        return self

    @property
    def every_step(self) -> bool:
        return self.mode == "every_step"

    @property
    def turn_steps(self) -> int:
        """Inner steps between two fragment syncs (every sync is a torchft commit)."""
        return self.sync_every // self.fragments
