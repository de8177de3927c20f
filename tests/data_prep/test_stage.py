"""DataPrepStage end to end on a temp dir: manifest, dedup, decontamination, outputs,
provenance, ladder probe, events; and its failed gates."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.base import GateOutcome, Stage, StageContext
from stages.data_prep import DataPrepConfig, DataPrepStage, file_sha256, folder_sha256
from stages.data_prep.config import (
    DataProvenance,
    DataRef,
    DecontaminationConfig,
    LadderProbeConfig,
)
from stages.data_prep.ladder import decide
from stages.errors import ErrorCode
from stages.events import Event, LogEvent, ProgressEvent

REPO = Path(__file__).resolve().parents[2]
PROV = DataProvenance(source="test corpus", license="MIT")
# A token budget small enough for seconds on a shared 2-core machine.
QUICK_PROBE = LadderProbeConfig(token_budget=16_384, eval_bytes=2_048)


def _jsonl(path: Path, field: str) -> list[str]:
    return [json.loads(line)[field] for line in path.read_text(encoding="utf-8").splitlines()]


def _write(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _ctx(tmp_path: Path) -> tuple[StageContext, list[Event]]:
    events: list[Event] = []
    return StageContext(
        run_id="run-1", booking_id="bk-1", workdir=tmp_path / "work", emit=events.append
    ), events


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, object]:
    """Baseline file + custom folder (jsonl and parquet) with 3 exact duplicates, 2
    near duplicates and 4 GSM8K test questions planted."""
    base = _write(
        tmp_path / "in" / "baseline.jsonl",
        _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")[:300],
    )
    # Train items 21..220 share no 13-gram with the test split (item 20 does: a real
    # near-copy of test item 632, which decontamination rightly flags).
    train = _jsonl(REPO / "data" / "gsm8k" / "train.jsonl", "question")[21:221]
    test = _jsonl(REPO / "configs" / "evals" / "gsm8k" / "test.jsonl", "question")
    custom = list(train)
    custom += [train[0], train[1], train[1]]  # exact duplicates
    custom += [train[2] + " Explain.", train[3].replace("?", "? Show your work.")]  # near
    custom += [test[0], "Homework: " + test[1].upper(), test[2], test[3]]  # contaminated
    folder = tmp_path / "in" / "custom"
    _write(folder / "part0.jsonl", custom[:150])
    pq.write_table(pa.table({"text": custom[150:]}), folder / "part1.parquet")
    refs = [
        DataRef(uri=f"file://{base}", sha256=file_sha256(base), role="baseline", provenance=PROV),
        DataRef(
            uri=f"file://{folder}", sha256=folder_sha256(folder), role="custom", provenance=PROV
        ),
    ]
    # The python docs hold 3 near-duplicate paragraph pairs of their own.
    return {"refs": refs, "docs": 300 + len(custom), "near_in_baseline": 3}


def test_stage_end_to_end(tmp_path: Path, corpus: dict) -> None:
    cfg = DataPrepConfig(refs=corpus["refs"], ladder_probe=QUICK_PROBE)
    stage = DataPrepStage(cfg)
    assert isinstance(stage, Stage) and stage.name == "data_prep"
    assert DataPrepStage.config_model is DataPrepConfig
    ctx, events = _ctx(tmp_path)
    out = stage.run(ctx)
    assert isinstance(out, GateOutcome) and out.passed, out.reason
    m = out.metrics
    assert m["docs_in"] == corpus["docs"]
    assert m["exact_duplicates"] == 3
    assert m["near_duplicates"] == 2 + corpus["near_in_baseline"]
    assert m["contaminated"] == 4
    assert m["docs_out"] == corpus["docs"] - 9 - corpus["near_in_baseline"]
    assert m["bytes_out"] < m["bytes_in"]
    # Cleaned training text, by role, with a "text" field.
    files = out.artifacts["train_files"]
    assert len(files["baseline"]) == 1 and len(files["custom"]) == 1
    rows = [
        json.loads(x)
        for f in files["baseline"] + files["custom"]
        for x in Path(f).read_text(encoding="utf-8").splitlines()
    ]
    assert len(rows) == m["docs_out"] and all(isinstance(r["text"], str) for r in rows)
    texts = {r["text"] for r in rows}
    test_q = _jsonl(REPO / "configs" / "evals" / "gsm8k" / "test.jsonl", "question")[:4]
    assert not texts & set(test_q)
    # Provenance: which eval item matched which document, with digests.
    prov = json.loads(Path(out.artifacts["provenance_path"]).read_text(encoding="utf-8"))
    dec = prov["decontamination"]
    assert dec["documents_contaminated"] == 4
    matched = {
        (row["doc"].split(":")[0], row["matches"][0]["item"])
        for row in dec["contaminated_documents"]
    }
    assert matched == {("1", 0), ("1", 1), ("1", 2), ("1", 3)}
    assert dec["eval_files"][0]["sha256"] == file_sha256(
        REPO / "configs" / "evals" / "gsm8k" / "test.jsonl"
    )
    assert [o["sha256"] for o in prov["outputs"]] == [
        file_sha256(f) for f in files["baseline"] + files["custom"]
    ]
    assert prov["inputs"][1]["sha256"] == corpus["refs"][1].sha256
    assert prov["dedup"]["parameters"]["bands"] == 21
    manifest = json.loads(Path(out.artifacts["data_manifest_path"]).read_text("utf-8"))
    assert [len(r["files"]) for r in manifest["refs"]] == [1, 2]
    # Ladder probe ran with equal tokens per arm and recorded its decision: the one the
    # decision rule gives on the recorded per-seed scores, and the stage's status with it.
    ladder = out.artifacts["ladder"]
    assert len(ladder["baseline_bpb"]) == len(ladder["custom_bpb"]) == 2
    decision, stats = decide(
        ladder["baseline_bpb"],
        ladder["custom_bpb"],
        QUICK_PROBE.confidence,
        QUICK_PROBE.min_effect_bpb,
    )
    assert ladder["decision"] == decision
    assert m["ladder_delta_bpb"] == pytest.approx(stats["delta_bpb"])
    assert out.status == ("no_decision" if decision == "no_decision" else "passed")
    logs = [e for e in events if isinstance(e, LogEvent)]
    assert logs and all(e.stage == "data_prep" for e in logs)
    # Streaming progress as stage events: every step, documents counted to the total.
    prog = [e for e in events if isinstance(e, ProgressEvent)]
    assert prog and all(e.stage == "data_prep" and e.docs_total == m["docs_in"] for e in prog)
    assert [e.step for e in prog if e.tasks_done == e.tasks_total][-1] == "filter"
    assert prog[-1].docs_done == m["docs_in"] and prog[-1].bytes_total > 0


def test_flag_instead_of_remove(tmp_path: Path, corpus: dict) -> None:
    cfg = DataPrepConfig(
        refs=corpus["refs"],
        decontamination=DecontaminationConfig(action="flag"),
        ladder_probe=LadderProbeConfig(enabled=False),
    )
    out = DataPrepStage(cfg).run(_ctx(tmp_path)[0])
    assert out.status == "passed" and out.artifacts["ladder"]["decision"] == "skipped"
    rows = [
        json.loads(x)
        for x in Path(out.artifacts["train_files"]["custom"][0]).read_text("utf-8").splitlines()
    ]
    assert sum(bool(r.get("contaminated")) for r in rows) == 4
    # Only duplicates removed.
    assert out.metrics["docs_out"] == corpus["docs"] - 5 - corpus["near_in_baseline"]


def test_digest_mismatch_fails_the_gate(tmp_path: Path, corpus: dict) -> None:
    good, custom = corpus["refs"]
    bad = custom.model_copy(update={"sha256": "f" * 64})
    out = DataPrepStage(DataPrepConfig(refs=[good, bad])).run(_ctx(tmp_path)[0])
    assert out.status == "failed" and not out.passed
    assert out.error_code == ErrorCode.data_digest_mismatch
    assert out.artifacts["mismatched"] == [custom.uri]
    assert not (tmp_path / "work" / "data_prep" / "clean").exists()


def test_remote_ref_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITO_DATA_CACHE", str(tmp_path / "empty-cache"))
    ref = DataRef(uri="hf://datasets/openai/gsm8k", sha256="0" * 64, provenance=PROV)
    out = DataPrepStage(DataPrepConfig(refs=[ref])).run(_ctx(tmp_path)[0])
    assert out.status == "failed" and out.error_code == ErrorCode.data_remote_not_cached


def test_cancelled_before_work(tmp_path: Path, corpus: dict) -> None:
    ctx, _ = _ctx(tmp_path)
    ctx.cancel_event.set()
    out = DataPrepStage(DataPrepConfig(refs=corpus["refs"])).run(ctx)
    assert out.status == "failed" and out.reason == "cancelled"


def test_reject_can_fail_the_gate(tmp_path: Path) -> None:
    base = _write(
        tmp_path / "in" / "b.jsonl",
        _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")[:600],
    )
    rng = random.Random(0)
    noise = _write(
        tmp_path / "in" / "n.jsonl",
        [
            " ".join(
                "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
                for _ in range(60)
            )
            for _ in range(600)
        ],
    )
    refs = [
        DataRef(uri=f"file://{base}", sha256=file_sha256(base), role="baseline", provenance=PROV),
        DataRef(uri=f"file://{noise}", sha256=file_sha256(noise), role="custom", provenance=PROV),
    ]
    probe = LadderProbeConfig(token_budget=48_000, eval_bytes=4_096, reject_fails_gate=True)
    out = DataPrepStage(DataPrepConfig(refs=refs, ladder_probe=probe)).run(_ctx(tmp_path)[0])
    assert out.artifacts["ladder"]["decision"] == "reject", out.artifacts["ladder"]["stats"]
    assert out.status == "failed" and out.error_code == ErrorCode.gate_failed
    assert Path(out.artifacts["provenance_path"]).is_file()


def test_probe_skipped_when_the_data_is_too_small(tmp_path: Path) -> None:
    base = _write(tmp_path / "b.jsonl", ["tiny baseline text"])
    custom = _write(tmp_path / "c.jsonl", ["tiny custom text"])
    refs = [
        DataRef(uri=f"file://{base}", sha256=file_sha256(base), role="baseline", provenance=PROV),
        DataRef(uri=f"file://{custom}", sha256=file_sha256(custom), provenance=PROV),
    ]
    out = DataPrepStage(DataPrepConfig(refs=refs, ladder_probe=QUICK_PROBE)).run(_ctx(tmp_path)[0])
    assert out.status == "passed" and out.artifacts["ladder"]["decision"] == "skipped"
    assert "shorter than one window" in out.artifacts["ladder"]["reason"]


def test_a_run_whose_fleet_was_never_placed_skips_the_probe(
    corpus: dict[str, object], tmp_path: Path
) -> None:
    """A run's probe borrows its trainer ranks; when the train stage could not place
    them (it reports why in its own turn), the probe is skipped at once, never waiting
    out the placement timeout, and the gate still decides on dedup and decontamination."""
    from stages.trainer.fleet.handoff import Fleet

    ctx, _ = _ctx(tmp_path)
    ctx.fleet = Fleet(tmp_path / "fleet")
    out = DataPrepStage(DataPrepConfig(refs=corpus["refs"], ladder_probe=QUICK_PROBE)).run(ctx)
    assert out.status == "passed", out.reason
    assert out.artifacts["ladder"]["decision"] == "skipped"
    assert "trainer ranks were not placed" in out.artifacts["ladder"]["reason"]
