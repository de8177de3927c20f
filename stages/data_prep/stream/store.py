"""The work folder of one streaming data-prep attempt: atomic files with digests.

Layout, all under ``<work>/<attempt key>/`` (the key is a digest of the inputs' bytes,
the block index and every parameter, so two different attempts never share a folder
and a resumed attempt only ever sees its own files):

- ``plan.json``: the block index (file, byte/row range, first document index of each
  block); the file name is a stored name, kept for compatibility;
- ``<stage>/...``: each task's outputs, each written atomically (``stages.atomic_write``);
- ``done/<stage>/<task>.json``: written by the task itself after its outputs, with the
  sha256 and size of each; a task is finished iff this record exists and its files
  still match it (a task killed half-way left no record, so it runs again);
- ``done/<stage>.json``: the stage's summary once every task finished.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from stages.atomic_write import write_bytes

if TYPE_CHECKING:
    from stages.data_prep.decontam import MatchRow


class FileMeta(TypedDict):
    """A written file as a task's record names it."""

    sha256: str
    bytes: int


def atomic_write(path: Path, data: bytes) -> FileMeta:
    """Write ``data`` to ``path`` (``stages.atomic_write``, durable); returns {sha256, bytes}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def write_arrays(path: Path, **arrays: np.ndarray) -> FileMeta:
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return atomic_write(path, buf.getvalue())


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: object) -> FileMeta:
    return atomic_write(path, (json.dumps(obj, sort_keys=True, default=str) + "\n").encode())


class ContaminatedDocument(TypedDict):
    """A document the filter task matched against the evals: its id and index in the
    input, its strongest matches, their total, and the eval items and suites hit."""

    doc: str
    index: int
    matches: list[MatchRow]
    total_matches: int
    items: list[int]
    suites: dict[str, int]


class TaskStats(TypedDict, total=False):
    """A task's counts; each stage's task writes its own keys (in the comments)."""

    docs: int  # sketch
    bytes: int  # sketch
    band_rows: int  # sketch, candidates
    exact_duplicates: int  # exact, filter
    pairs: int  # candidates, fetch
    candidate_pairs: int  # verify
    verified_pairs: int  # verify, components
    clusters: int  # components
    near_duplicates: int  # components, filter
    examples: list[list[int]]  # components: [duplicate, survivor] document indices
    # filter: its counts, the documents it matched, and its shard and ids file.
    docs_in: int
    docs_out: int
    bytes_in: int
    bytes_out: int
    contaminated: int
    contaminated_documents: list[ContaminatedDocument]
    shard: str
    sha256: str
    shard_bytes: int
    ids: str


class TaskRecord(TypedDict):
    """A finished task, as ``done/<stage>/<task>.json`` records it: its outputs
    (relative path -> digest) and its counts."""

    stage: str
    task: str
    outputs: dict[str, FileMeta]
    stats: TaskStats


class StageSummary(TypedDict):
    """A finished stage (``done/<stage>.json``): every task's record, by task."""

    tasks: dict[str, TaskRecord]


class WorkDir:
    """One attempt's folder (``root`` already includes the attempt key)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    def done_path(self, stage: str, task: str) -> Path:
        return self.root / "done" / stage / f"{task}.json"

    def record(
        self, stage: str, task: str, outputs: dict[str, FileMeta], stats: TaskStats
    ) -> TaskRecord:
        """Mark a task finished: its outputs (relative path -> digest) and counts."""
        rec: TaskRecord = {"stage": stage, "task": task, "outputs": outputs, "stats": stats}
        write_json(self.done_path(stage, task), rec)
        return rec

    def finished(self, stage: str, task: str, verify: bool = True) -> TaskRecord | None:
        """The task's record if it finished and its outputs are intact, else None."""
        p = self.done_path(stage, task)
        if not p.exists():
            return None
        try:
            rec: TaskRecord = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        for rel, meta in rec.get("outputs", {}).items():
            f = self.root / rel
            if not f.exists() or f.stat().st_size != meta["bytes"]:
                return None
            if verify and file_digest(f) != meta["sha256"]:
                return None
        return rec

    def stage_done(self, stage: str) -> StageSummary | None:
        p = self.root / "done" / f"{stage}.json"
        if not p.exists():
            return None
        try:
            out: StageSummary = json.loads(p.read_text())
            return out
        except (OSError, ValueError):
            return None

    def mark_stage(self, stage: str, summary: StageSummary) -> None:
        write_json(self.root / "done" / f"{stage}.json", summary)
