"""The tests' in-process RLVR learner's resume state, saved into the run's workdir
(``in_process_learner``; the engine's learner resumes from its DCP checkpoints).

One file per saved step (``rlvr-resume/step-<n>.pt``, torch.save written to a temp
name, fsynced, renamed, the folder fsynced): the policy, the optimizer, the policy
version, the mean rewards so far, and the fleet's admission state (the controller's
version and request cursor). A resumed run publishes the restored weights as that
version and regenerates every request from the cursor on: request ids are consecutive
and request ``k`` is always the same prompt and seed, so nothing walked before the
save is trained twice, and nothing generated before the resume can be trained (it is
gone, and the staleness checks would refuse it anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.atomic_write import open_atomic

RESUME_DIR = "rlvr-resume"
KEEP_NEWEST = 2  # the newest file may be the one being replaced when the run dies


def _path(workdir: Path, step: int) -> Path:
    return workdir / RESUME_DIR / f"step-{step:08d}.pt"


def save_resume(workdir: Path, step: int, state: dict[str, Any]) -> Path:
    import torch

    path = _path(workdir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_atomic(path) as f:
        torch.save({"step": step, **state}, f)
    for old in sorted(path.parent.glob("step-*.pt"))[:-KEEP_NEWEST]:
        old.unlink(missing_ok=True)
    return path


def load_newest(workdir: Path) -> dict[str, Any] | None:
    """The newest complete resume state, or None (temp files are never read)."""
    import torch

    files = sorted((workdir / RESUME_DIR).glob("step-*.pt"))
    if not files:
        return None
    state: dict[str, Any] = torch.load(files[-1], map_location="cpu", weights_only=False)
    return state
