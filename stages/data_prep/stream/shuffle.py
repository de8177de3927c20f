"""What every streaming task reads and writes in its work folder: the run's block
index and parameters, and the shuffle files keyed by destination (a map task writes
``<folder>/to-<d>.npz`` per destination, the reduce task reads every file addressed
to it)."""

from __future__ import annotations

import itertools
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from stages.data_prep.stream.blocks import BlockIndex
from stages.data_prep.stream.store import FileMeta, WorkDir, read_arrays, write_arrays


@lru_cache(maxsize=4)
def load_run(root: str) -> tuple[BlockIndex, dict[str, Any], np.ndarray]:
    r = Path(root)
    # "plan.json": a stored file name (written by run.py), kept for compatibility.
    blocks_index = BlockIndex.from_json(json.loads((r / "plan.json").read_text()))
    params = json.loads((r / "params.json").read_text())
    starts = np.array([b.doc_start for b in blocks_index.blocks], dtype=np.int64)
    return blocks_index, params, starts


def block_of(starts: np.ndarray, docs: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, docs, side="right") - 1


def rel_path(wd: WorkDir, p: Path) -> str:
    return p.relative_to(wd.root).as_posix()


def scatter(
    wd: WorkDir, folder: str, dest: np.ndarray, n_dest: int, **cols: np.ndarray
) -> dict[str, FileMeta]:
    """Write the rows of ``cols`` to ``<folder>/to-<d>.npz`` per destination ``d`` (only
    the non-empty ones); returns the outputs for the task's done record."""
    outputs: dict[str, FileMeta] = {}
    if len(dest) == 0:
        return outputs
    order = np.argsort(dest, kind="stable")
    sd = dest[order]
    cuts = np.flatnonzero(np.r_[True, sd[1:] != sd[:-1], True])
    for a, z in itertools.pairwise(cuts):
        d = int(sd[a])
        assert 0 <= d < n_dest
        sel = order[a:z]
        path = wd.path(folder, f"to-{d:05d}.npz")
        outputs[rel_path(wd, path)] = write_arrays(path, **{k: v[sel] for k, v in cols.items()})
    return outputs


def gather(wd: WorkDir, pattern: str) -> list[dict[str, np.ndarray]]:
    return [read_arrays(p) for p in sorted(wd.root.glob(pattern))]


def concat(parts: list[dict[str, np.ndarray]], key: str, dtype: npt.DTypeLike) -> np.ndarray:
    arrs = [p[key] for p in parts]
    return np.concatenate(arrs).astype(dtype, copy=False) if arrs else np.zeros(0, dtype)


def text_bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)
