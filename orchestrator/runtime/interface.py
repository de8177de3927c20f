"""What the API server calls after it commits a state-changing mutation.

The server commits first (the store is the truth), then tells the runtime. The
Ray runtime (supervisor + RunDriver actors) implements this protocol; until it
is wired in, ``NullRuntime`` keeps runs ``accepted`` and handles cancel and
cleanup locally so the API is complete and testable.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal, Protocol, TypedDict, runtime_checkable

from orchestrator.db.store import Store
from orchestrator.runs import RunState

Decision = Literal["approved", "declined"]


class CleanupResult(TypedDict):
    """What a run's cleanup removed: the paths, and their bytes."""

    removed: list[str]
    bytes_removed: int


@runtime_checkable
class RunRuntime(Protocol):
    def start(self) -> None:
        """Called once when the server starts (reattach to live runs, reconcile)."""

    def stop(self) -> None:
        """Called once when the server stops; runs keep going where they can."""

    def submit(self, run_id: str) -> None:
        """A run was committed in state ``accepted``."""

    def cancel(self, run_id: str) -> None:
        """A run was committed in state ``cancelling``; drive it to ``cancelled``."""

    def cleanup(self, run_id: str) -> CleanupResult:
        """A terminal run was committed ``cleaned``: remove its scratch and checkpoints.
        Never touches the booking."""

    def decide(self, run_id: str, proposal_id: str, decision: Decision) -> None:
        """A human approved or declined a proposal (already committed)."""


def run_dir(var_dir: Path, run_id: str) -> Path:
    return var_dir / "runs" / run_id


def remove_tree(path: Path) -> tuple[list[str], int]:
    """Remove ``path`` (no symlink following); returns (removed paths, bytes)."""
    if not path.exists() and not path.is_symlink():
        return [], 0
    size = 0
    if path.is_dir() and not path.is_symlink():
        for p in path.rglob("*"):
            if p.is_file() and not p.is_symlink():
                size += p.stat().st_size
        shutil.rmtree(path)
    else:
        size = path.lstat().st_size
        path.unlink()
    return [str(path)], size


class NullRuntime:
    """No executor: runs stay ``accepted``; cancel completes at once; cleanup removes
    ``<var_dir>/runs/<run_id>``."""

    def __init__(self, store: Store, var_dir: Path):
        self.store = store
        self.var_dir = var_dir

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def submit(self, run_id: str) -> None:
        return None

    def cancel(self, run_id: str) -> None:
        run = self.store.get_run(run_id)
        if run["state"] == RunState.cancelling:
            self.store.transition(run_id, RunState.cancelled, "cancelled (no runtime attached)")

    def cleanup(self, run_id: str) -> CleanupResult:
        removed, size = remove_tree(run_dir(self.var_dir, run_id))
        return {"removed": removed, "bytes_removed": size}

    def decide(self, run_id: str, proposal_id: str, decision: Decision) -> None:
        return None
