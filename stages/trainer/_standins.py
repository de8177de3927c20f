"""Private stand-ins for part A's pieces until they land (deleted once they do)."""

from __future__ import annotations

import statistics
from collections import deque

from stages.trainer.config import LossSpikeConfig


class LossSpikeDetector:
    """Rolling robust z-score (median / MAD) of the loss."""

    def __init__(self, config: LossSpikeConfig):
        self.config = config
        self.window: deque[float] = deque(maxlen=config.window)
        self.seen = 0

    def observe(self, step: int, loss: float) -> bool:
        self.seen += 1
        spike = False
        if self.seen > self.config.min_steps and len(self.window) >= 5:
            med = statistics.median(self.window)
            mad = statistics.median(abs(x - med) for x in self.window) or 1e-8
            spike = (loss - med) / (1.4826 * mad) > self.config.z_threshold
        if not spike:
            self.window.append(loss)
        return spike
