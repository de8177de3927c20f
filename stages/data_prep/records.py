"""Documents with their origin, cleaned-output writers, and the dedup provenance section."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.atomic_write import open_atomic, write_text
from stages.data_prep.config import DedupConfig
from stages.data_prep.dedup import DedupResult
from stages.data_prep.refs import (
    DATA_SUFFIXES,
    ResolvedRef,
    data_files,
    read_records,
    read_texts,
)

# Near-duplicate (dropped -> survivor) examples kept in the provenance record; the
# counts are always exact.
MAX_DUPLICATE_EXAMPLES = 1_000


@dataclass
class Corpus:
    """Documents in input order, each with a stable id "<ref>:<file>:<n>" and a role."""

    texts: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    refs: list[int] = field(default_factory=list)
    # The caller's records as read (command-line input only): written back unchanged.
    records: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def add_ref(self, k: int, resolved: ResolvedRef) -> list[dict[str, Any]]:
        """Read every file of one ref; returns per-file {path, sha256, bytes, docs}."""
        files = []
        for f in resolved.files:
            before = len(self.texts)
            for n, text in enumerate(read_texts(f.path, f.format, resolved.ref.text_field)):
                self.texts.append(text)
                self.ids.append(f"{k}:{f.relpath}:{n}")
                self.roles.append(resolved.ref.role)
                self.refs.append(k)
            files.append(
                {
                    "path": str(f.path),
                    "relpath": f.relpath,
                    "format": f.format,
                    "sha256": f.sha256,
                    "bytes": f.bytes,
                    "docs": len(self.texts) - before,
                }
            )
        return files


def read_input(path: Path, text_field: str = "text") -> Corpus:
    """A file or folder given on the command line, as one corpus (role "custom")."""
    corpus = Corpus()
    files = data_files(path) if path.is_dir() else [path]
    for f in files:
        rel = f.relative_to(path).as_posix() if path.is_dir() else f.name
        fmt = DATA_SUFFIXES.get(f.suffix, "jsonl")
        for n, (record, text) in enumerate(read_records(f, fmt, text_field)):
            corpus.records.append(record)
            corpus.texts.append(text)
            corpus.ids.append(f"0:{rel}:{n}")
            corpus.roles.append("custom")
            corpus.refs.append(0)
    return corpus


def text_bytes(texts: Iterable[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> tuple[str, int, int]:
    """Write rows atomically; returns (sha256, bytes, rows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    h, size, count = hashlib.sha256(), 0, 0
    with open_atomic(path) as f:
        for row in rows:
            line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            h.update(line)
            size += len(line)
            count += 1
    return h.hexdigest(), size, count


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def dedup_record(result: DedupResult, cfg: DedupConfig, ids: Sequence[str]) -> dict[str, Any]:
    dup_of = result.duplicate_of()
    examples = [
        {"doc": ids[d], "survivor": ids[s]}
        for d, s in sorted(dup_of.items())[:MAX_DUPLICATE_EXAMPLES]
    ]
    return {
        "method": "exact text match, then MinHash LSH verified by exact Jaccard, union-find",
        "parameters": {
            "threshold": cfg.threshold,
            "num_perm": cfg.num_perm,
            "shingle_size": cfg.shingle_size,
            "seed": cfg.seed,
            "bands": result.bands,
            "rows": result.rows,
            "recall_target": cfg.recall_target,
            "survivor": "lowest input index in the cluster",
        },
        "backend": result.backend,
        "shards": result.shards,
        "exact_duplicates": result.exact_duplicates,
        "near_duplicates": result.near_duplicates,
        "clusters": len(result.clusters),
        "candidate_pairs": result.candidate_pairs,
        "verified_pairs": len(result.verified_pairs),
        "near_duplicate_examples": examples,
    }
