"""Streaming dedup and filtering in one process: the same survivors as the in-memory
dedup, every input field kept, outputs in both formats, progress, no mixing of
attempts. (Ray Data and SIGKILL runs: test_stream_ray.py, test_stream_resume.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.xdist_groups import module_group

from stages.data_prep.config import DecontaminationConfig, DedupConfig
from stages.data_prep.dedup import dedup
from stages.data_prep.evals import EvalItem
from stages.data_prep.stream import StreamConfig, input_files, run_stream
from stages.data_prep.stream.run import Progress
from stages.data_prep.stream.tasks import connected_components
from stages.data_prep.synth import planted_pair_corpus

pytestmark = module_group(__name__)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three files of three formats, with planted near-duplicates, exact copies across
    files and extra fields the caller cares about."""
    texts, _ = planted_pair_corpus(900, 300, seed=11)
    texts += texts[:40]  # exact copies, in a later file than their originals
    folder = tmp_path_factory.mktemp("in")
    a, b = texts[:500], texts[500:1000]
    with open(folder / "a.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(a):
            f.write(json.dumps({"doc_id": f"a{i}", "text": t, "meta": {"n": i, "src": "x"}}) + "\n")
            if i % 97 == 0:
                f.write("\n")  # blank lines are not documents
    pq.write_table(
        pa.table(
            {
                "text": b,
                "doc_id": [f"b{i}" for i in range(len(b))],
                "score": np.arange(len(b), dtype=np.float64),
            }
        ),
        folder / "b.parquet",
        row_group_size=128,
    )
    (folder / "c.txt").write_text("\n".join(texts[1000:]) + "\n", encoding="utf-8")
    return {"folder": folder, "texts": texts}


def _files(folder: Path) -> list:
    return [(p, rel, fmt, 0, "custom") for p, rel, fmt in input_files(folder)]


def _rows(out: Path, fmt: str = "jsonl") -> list[dict]:
    manifest = json.loads((out / "manifest.json").read_text())
    rows: list[dict] = []
    for sh in manifest["shards"]:
        if fmt == "jsonl":
            rows += [json.loads(x) for x in (out / sh["path"]).read_text("utf-8").splitlines()]
        else:
            rows += pq.read_table(out / sh["path"]).to_pylist()
    return rows


def test_same_survivors_as_in_memory_dedup_with_every_field_kept(
    tmp_path: Path, corpus: dict
) -> None:
    texts = corpus["texts"]
    ref = dedup(texts, DedupConfig(), use_ray=False)
    events: list[Progress] = []
    res = run_stream(
        _files(corpus["folder"]),
        tmp_path / "out",
        dedup_cfg=DedupConfig(),
        cfg=StreamConfig(block_docs=137),
        progress=events.append,
    )
    assert len(res.blocks_index.blocks) > 8 and res.executor == "local"
    rows = _rows(tmp_path / "out")
    assert [r["text"] for r in rows] == [texts[i] for i in np.flatnonzero(ref.keep)]
    assert res.counts["exact_duplicates"] == ref.exact_duplicates == 40
    assert res.counts["near_duplicates"] == ref.near_duplicates > 50
    assert res.dedup is not None and res.dedup["clusters"] == len(ref.clusters)
    # Every input field is kept: jsonl lines byte for byte, parquet columns as typed.
    a_lines = {ln for ln in (corpus["folder"] / "a.jsonl").read_text("utf-8").splitlines() if ln}
    out_lines = (tmp_path / "out" / res.shards[0]["path"]).read_text("utf-8").splitlines()
    assert out_lines and set(out_lines) <= a_lines
    from_b = [r for r in rows if str(r.get("doc_id", "")).startswith("b")]
    assert from_b and all(set(r) == {"text", "doc_id", "score"} for r in from_b)
    assert all(isinstance(r["score"], float) for r in from_b)
    assert {"doc_id", "text", "meta"} == set(rows[0])
    # Progress: every step reported, documents counted up to the total, nothing after.
    steps = [e.stage for e in events]
    assert list(dict.fromkeys(steps)) == [
        "sketch",
        "exact",
        "candidates",
        "fetch",
        "verify",
        "components",
        "filter",
    ]
    final = [e for e in events if e.tasks_done == e.tasks_total]
    assert all(
        e.docs_done == e.docs_total == len(texts) for e in final if e.stage in ("sketch", "filter")
    )
    assert all(e.bytes_total > 0 for e in events)
    assert not (tmp_path / "out.work").exists()  # removed after success


def test_parquet_output_and_decontamination_flag(tmp_path: Path, corpus: dict) -> None:
    texts = corpus["texts"]
    item = EvalItem(suite="t", index=0, file="t.jsonl", text=texts[3])
    res = run_stream(
        _files(corpus["folder"]),
        tmp_path / "out",
        dedup_cfg=None,
        decon=(DecontaminationConfig(action="flag"), [item]),
        cfg=StreamConfig(block_docs=300, output_format="parquet"),
    )
    rows = _rows(tmp_path / "out", "parquet")
    assert len(rows) == len(texts) and res.counts["docs_out"] == len(texts)
    flagged = [r for r in rows if r.get("contaminated")]
    # texts[3] and its exact copy at 900+3 (the planted copies of it may match too).
    assert {r["text"] for r in flagged} >= {texts[3]} and res.counts["contaminated"] >= 2
    assert res.contaminated_documents[0]["doc"] == "0:a.jsonl:3"


def test_changed_input_never_reuses_an_attempt(tmp_path: Path, corpus: dict) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    lines = (corpus["folder"] / "a.jsonl").read_text("utf-8").splitlines(keepends=True)
    (folder / "a.jsonl").write_text("".join(lines[:300]), encoding="utf-8")
    cfg = StreamConfig(block_docs=50)
    first = run_stream(
        _files(folder),
        tmp_path / "o1",
        dedup_cfg=DedupConfig(),
        cfg=cfg,
        work_dir=tmp_path / "work",
        keep_work=True,
    )
    again = run_stream(
        _files(folder),
        tmp_path / "o1",
        dedup_cfg=DedupConfig(),
        cfg=cfg,
        work_dir=tmp_path / "work",
        keep_work=True,
    )
    assert again.attempt == first.attempt and again.resumed_tasks > 0
    (folder / "a.jsonl").write_text("".join(lines[:299]) + lines[0], encoding="utf-8")
    changed = run_stream(
        _files(folder),
        tmp_path / "o1",
        dedup_cfg=DedupConfig(),
        cfg=cfg,
        work_dir=tmp_path / "work",
        keep_work=True,
    )
    assert changed.attempt != first.attempt and changed.resumed_tasks == 0
    assert changed.counts["exact_duplicates"] == first.counts["exact_duplicates"] + 1
    manifest = json.loads((tmp_path / "o1" / "manifest.json").read_text())
    assert manifest["attempt"] == changed.attempt


def test_connected_components_roots_are_component_minima() -> None:
    rng = np.random.default_rng(0)
    i = rng.integers(0, 400, 300)
    j = rng.integers(0, 400, 300)
    keep = i != j
    i, j = np.minimum(i, j)[keep], np.maximum(i, j)[keep]
    nodes, root = connected_components(i, j)
    # Reference: plain union-find.
    parent = {int(n): int(n) for n in nodes}

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in zip(i.tolist(), j.tolist(), strict=True):
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    assert root.tolist() == [find(int(n)) for n in nodes]
    # A long chain (worst case for label propagation) still converges.
    chain = np.arange(5000)
    _, r = connected_components(chain[:-1], chain[1:])
    assert (r == 0).all()
