"""The loop's view of checkpoints: save / poll / latest / load of model, optimizer and
the loop's own extras (step, skipped data windows, loader position).

Stand-in implementation (sync DCP + completion marker) until stages.checkpointing's
async Checkpointer lands; the loop only uses this small surface.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.checkpointing.config import CheckpointPolicy

_DONE = ".complete"


@dataclass
class SavedCheckpoint:
    step: int
    path: str
    bytes: int
    blocking_s: float
    total_s: float


def list_complete(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*")
                  if (p / _DONE).is_file())


class CheckpointIO:
    def __init__(self, policy: CheckpointPolicy, root: Path):
        self.policy = policy
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._done: list[SavedCheckpoint] = []
        self._last_save_t = time.monotonic()
        self._last_step = -1

    def due(self, step: int) -> bool:
        if step == self._last_step:
            return False
        p = self.policy
        if p.interval_steps and step % p.interval_steps == 0:
            return True
        return bool(p.interval_minutes and
                    time.monotonic() - self._last_save_t >= p.interval_minutes * 60)

    def save(self, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer,
             extra: dict[str, Any]) -> bool:
        import torch.distributed.checkpoint as dcp

        if step in list_complete(self.root):
            return False
        t0 = time.time()
        path = self.root / f"step_{step:08d}"
        if path.exists():
            shutil.rmtree(path)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)
        (path / "extra.json").write_text(json.dumps(extra))
        (path / _DONE).write_text("")
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        dt = time.time() - t0
        self._done.append(SavedCheckpoint(step, str(path), size, dt, dt))
        self._last_save_t = time.monotonic()
        self._last_step = step
        for old in list_complete(self.root)[:-self.policy.keep]:
            shutil.rmtree(self.root / f"step_{old:08d}", ignore_errors=True)
        return True

    def poll(self) -> list[SavedCheckpoint]:
        done, self._done = self._done, []
        return done

    def wait(self) -> None:
        return None

    def latest(self) -> int | None:
        steps = list_complete(self.root)
        return steps[-1] if steps else None

    def load(self, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer
             ) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = self.root / f"step_{step:08d}"
        msd, osd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return dict(json.loads((path / "extra.json").read_text()))
