"""Loss-spike detection with a rolling robust z-score, and the restart it proposes.

The z-score of a loss is ``(loss - median) / (1.4826 * MAD)`` over the last
``window`` accepted losses: median and MAD ignore the occasional outlier that a
mean / std would chase. Only upward deviations count. A NaN or infinite loss is
always a spike. Spikes are kept out of the window so one bad step does not raise
the bar for the next. Detection starts after ``min_steps`` observations.

A spike does not act by itself: ``propose`` turns it into a ``ProposalEvent``,
"restart from checkpoint S, skipping data window W", that a human approves or
declines (PaLM's remedy: rewind to a checkpoint before the spike and skip the
batches seen from there through the spike). On approval the loop loads S,
calls ``loader.skip(params["skip_batches"])`` and ``Checkpointer.discard_after(S)``.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from stages.events import ProposalEvent
from stages.trainer.config import LossSpikeConfig

# MAD -> standard deviation for normally distributed losses.
_MAD_TO_STD = 1.4826
# A flat window (MAD = 0) still needs a scale: this fraction of |median|, so a
# perfectly constant loss does not turn every tiny wiggle into an infinite z.
_MIN_SCALE_FRACTION = 1e-3
_MIN_SCALE = 1e-8


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class LossSpike(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    step: int
    loss: float
    z: float
    median: float
    mad: float
    non_finite: bool = False


class ReportedSpike(LossSpike):
    """A spike as its rank reports it (``RankReport.spike``): with the loader batch
    that spiked and the data windows the rank skips, from which the driver proposes
    the restore."""

    batch: int
    windows: list[tuple[int, int]]


class LossSpikeDetector:
    def __init__(self, config: LossSpikeConfig):
        self.config = config
        self._window: deque[float] = deque(maxlen=config.window)
        self.observed = 0
        self.spikes = 0

    def zscore(self, loss: float) -> tuple[float, float, float]:
        """(z, median, MAD) of ``loss`` against the current window."""
        values = np.fromiter(self._window, dtype=np.float64)
        median = float(np.median(values))
        mad = float(np.median(np.abs(values - median)))
        scale = max(_MAD_TO_STD * mad, _MIN_SCALE_FRACTION * abs(median), _MIN_SCALE)
        return (loss - median) / scale, median, mad

    def observe(self, step: int, loss: float) -> LossSpike | None:
        """Feed one step's loss; a ``LossSpike`` if it is one."""
        if not self.config.enabled:
            return None
        self.observed += 1
        if not math.isfinite(loss):
            self.spikes += 1
            median = float(np.median(list(self._window))) if self._window else math.nan
            return LossSpike(
                step=step, loss=loss, z=math.inf, median=median, mad=math.nan, non_finite=True
            )
        if self.observed > self.config.min_steps and len(self._window) >= 2:
            z, median, mad = self.zscore(loss)
            if z > self.config.z_threshold:
                self.spikes += 1
                return LossSpike(step=step, loss=loss, z=z, median=median, mad=mad)
        self._window.append(loss)
        return None

    def reset(self) -> None:
        """Forget the window (e.g. after a declined proposal, when the loss level moved
        for good): detection restarts after ``min_steps``."""
        self._window.clear()
        self.observed = 0

    def propose(
        self, spike: LossSpike, latest_checkpoint_step: int | None, batches_per_step: int = 1
    ) -> ProposalEvent:
        """The restart a human should approve: rewind to the latest checkpoint S and
        skip the batches of steps S+1 .. max(spike, S + skip_window_steps).

        ``batches_per_step`` is this rank's loader batches per optimizer step
        (gradient accumulation). ``latest_checkpoint_step`` None means no checkpoint
        exists: the restart is from the initial weights (step 0).
        """
        if batches_per_step <= 0:
            raise ValueError("batches_per_step must be positive")
        from_step = latest_checkpoint_step or 0
        end_step = max(spike.step, from_step + self.config.skip_window_steps)
        skip_steps = end_step - from_step
        what = "non-finite loss" if spike.non_finite else f"loss {spike.loss:.4g} (z {spike.z:.1f})"
        source = f"checkpoint {from_step}" if latest_checkpoint_step is not None else "step 0"
        return ProposalEvent(
            stage="trainer",
            proposal_id=f"loss-spike-{spike.step}-{uuid.uuid4().hex[:8]}",
            action="restart_from_checkpoint",
            description=(
                f"loss spike at step {spike.step}: {what}; restart from {source}, "
                f"skipping the data of steps {from_step + 1}-{end_step} "
                f"({skip_steps * batches_per_step} batches)"
            ),
            params={
                "from_step": from_step,
                "from_checkpoint": latest_checkpoint_step is not None,
                "skip_batches": skip_steps * batches_per_step,
                "skip_steps": skip_steps,
                "window_start_step": from_step + 1,
                "window_end_step": end_step,
                "spike_step": spike.step,
                # JSON has no NaN/inf: a non-finite loss is flagged instead.
                "non_finite": spike.non_finite,
                "loss": _finite_or_none(spike.loss),
                "z": _finite_or_none(spike.z),
                "median": _finite_or_none(spike.median),
            },
        )

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self._window), "observed": self.observed, "spikes": self.spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = deque((float(x) for x in state["window"]), maxlen=self.config.window)
        self.observed = int(state["observed"])
        self.spikes = int(state["spikes"])
