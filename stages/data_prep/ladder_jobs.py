"""What the ladder probe hands the place that trains its proxies: the jobs (an arm and a
seed each) and the runner that trains them. Here, apart from ``ladder`` (which plans
the jobs and decides) and ``ladder_arm`` (the torch side that trains one), so that
each stands on this without importing the other."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from stages.data_prep.config import LadderProbeConfig


@dataclass(frozen=True)
class ArmJob:
    """One proxy training: an arm ("baseline" or "custom") and a seed."""

    arm: str
    seed: int
    steps: int


# Runs the jobs (``score_arm`` of stages.data_prep.ladder_arm for each, on the given
# training stream and eval windows) and yields (job, bits per byte, device, where it
# trained) as each ends.
ArmRunner = Callable[
    [list[ArmJob], dict[str, np.ndarray], np.ndarray, LadderProbeConfig],
    Iterator[tuple[ArmJob, float, str, str]],
]

IN_PROCESS = "in-process"
