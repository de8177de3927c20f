"""How a run's pipeline hands its stages to the driver: a factory per stage, built from
the run's context when the stage's turn comes, or made ahead of it (``StartEarly``).

``orchestrator.runtime.pipeline`` builds them and ``orchestrator.runtime.driver`` runs
them; both stand on this module, and neither imports the other's names back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stages.base import Stage, StageContext

StageFactory = Callable[[StageContext], Stage]


@dataclass(frozen=True)
class StartEarly:
    """A stage factory whose stage is made as soon as stage ``after`` passed and whose
    ``prestart(ctx)`` then runs, so it prepares (e.g. places and warms the trainer
    fleet) while the stages between run; ``abandon()`` undoes it when the run ends
    before the stage's turn. The stage's ``run`` is the same either way."""

    make: StageFactory
    after: str

    def __call__(self, ctx: StageContext) -> Stage:
        return self.make(ctx)
