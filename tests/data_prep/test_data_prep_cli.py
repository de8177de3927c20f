"""``python -m stages.data_prep`` as a user runs it: a subprocess, JSON on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stages.data_prep.refs import file_sha256

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _cli(*args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "stages.data_prep", *args, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_dedup_command(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    docs = [
        "the quick brown fox jumps over the lazy dog near the river bank today",
        "the quick brown fox jumps over the lazy dog near the river bank today",
        "the quick brown fox jumps over the lazy dog near the river bank today!",
        "the quick brown fox jumps over the lazy dog near the river bank today and",
        "an entirely different sentence about grade school arithmetic problems",
    ]
    (folder / "a.jsonl").write_text(
        "".join(
            json.dumps({"id": f"mine-{n}", "text": d, "meta": {"source": "crawl", "n": n}}) + "\n"
            for n, d in enumerate(docs[:3])
        )
    )
    (folder / "b.txt").write_text("\n".join(docs[3:]) + "\n")
    out = tmp_path / "out" / "clean.jsonl"
    rc, summary = _cli("dedup", "--input", str(folder), "--output", str(out))
    assert rc == 0 and summary["ok"]
    assert summary["docs_in"] == 5 and summary["docs_out"] == 2
    assert summary["exact_duplicates"] == 1 and summary["near_duplicates"] == 2
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    # The caller's records come back as they were (their own id and every field);
    # provenance lives in the provenance file.
    assert kept == [
        {"id": "mine-0", "text": docs[0], "meta": {"source": "crawl", "n": 0}},
        {"text": docs[4]},
    ]
    prov = json.loads(Path(summary["provenance_path"]).read_text())
    assert prov["output_rows"] == ["0:a.jsonl:0", "0:b.txt:1"]
    assert prov["output"]["sha256"] == file_sha256(out)
    assert prov["dedup"]["near_duplicate_examples"][0]["survivor"] == "0:a.jsonl:0"


def test_decontaminate_command(tmp_path: Path) -> None:
    evals = tmp_path / "evals.jsonl"
    question = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half "
        "as many clips in May. How many clips did Natalia sell altogether?"
    )
    evals.write_text(json.dumps({"question": question}) + "\n")
    lines = tmp_path / "items.txt"
    lines.write_text("what is seven times six\n")
    data = tmp_path / "train.jsonl"
    docs = [
        "Practice: " + question.upper(),
        "What is SEVEN times six? 42.",
        "A harmless document about birds and their migration over the sea.",
    ]
    records = [{"id": 100 + n, "body": d, "label": n % 2} for n, d in enumerate(docs)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "clean.jsonl"
    rc, summary = _cli(
        "decontaminate",
        "--input",
        str(data),
        "--text-field",
        "body",
        "--eval",
        str(evals),
        str(lines),
        "--output",
        str(out),
    )
    assert rc == 0 and summary["contaminated"] == 2 and summary["docs_out"] == 1
    assert summary["eval_items"] == 2 and summary["ngram"] == 13
    prov = json.loads(Path(summary["provenance_path"]).read_text())
    methods = {
        row["matches"][0]["method"] for row in prov["decontamination"]["contaminated_documents"]
    }
    assert methods == {"ngram", "exact"}
    assert [json.loads(x) for x in out.read_text().splitlines()] == [records[2]]
    assert prov["output_rows"] == ["0:train.jsonl:2"]
    rc, summary = _cli(
        "decontaminate",
        "--input",
        str(data),
        "--text-field",
        "body",
        "--eval",
        str(evals),
        "--output",
        str(out),
        "--action",
        "flag",
    )
    assert rc == 0 and summary["docs_out"] == 3 and summary["contaminated"] == 1
    flagged = [json.loads(x) for x in out.read_text().splitlines()]
    assert flagged == [{**records[0], "contaminated": True}, records[1], records[2]]
    # A flag field that would overwrite a caller's field is refused.
    rc, summary = _cli(
        "decontaminate",
        "--input",
        str(data),
        "--text-field",
        "body",
        "--eval",
        str(evals),
        "--output",
        str(out),
        "--action",
        "flag",
        "--flag-field",
        "label",
    )
    assert rc == 2 and summary["error"]["code"] == "bad_request"


def test_errors_carry_stable_codes(tmp_path: Path) -> None:
    rc, summary = _cli(
        "dedup", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o.jsonl")
    )
    assert rc == 2 and summary == {
        "ok": False,
        "error": {
            "code": "data_not_found",
            "message": f"no such file or folder: {tmp_path / 'missing'}",
        },
    }


def test_records_keep_every_field_in_sharded_parquet(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    data = tmp_path / "in.jsonl"
    rows = [
        {
            "uid": f"u{i}",
            "text": f"document number {i} says something of its own {i * 7}",
            "meta": {"lang": "en", "n": i},
        }
        for i in range(50)
    ]
    rows.append({**rows[3], "uid": "copy-of-3"})  # exact duplicate text, other fields
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "shards"
    rc, summary = _cli(
        "dedup",
        "--input",
        str(data),
        "--output",
        str(out),
        "--output-format",
        "parquet",
        "--block-docs",
        "20",
    )
    assert rc == 0 and summary["blocks"] == 3 and summary["executor"] == "local"
    assert summary["docs_out"] == 50 and summary["exact_duplicates"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == [f"part-0000{i}.parquet" for i in range(3)]
    got = [r for s in manifest["shards"] for r in pq.read_table(out / s["path"]).to_pylist()]
    assert got == rows[:50]  # every field, in input order; the later copy dropped
    prov = json.loads(Path(summary["provenance_path"]).read_text())
    assert prov["input"]["sha256"] == file_sha256(data)
    assert [s["sha256"] for s in prov["output"]["shards"]] == [
        file_sha256(out / s["path"]) for s in manifest["shards"]
    ]
    rc, summary = _cli(
        "dedup",
        "--input",
        str(data),
        "--output",
        str(tmp_path / "x.jsonl"),
        "--output-format",
        "parquet",
    )
    assert rc == 2 and summary["error"]["code"] == "bad_request"
