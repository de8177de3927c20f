"""Data refs: digests (file and folder rule), remote refusal and the local cache,
formats."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data_prep.config import DataProvenance, DataRef
from stages.data_prep.refs import (
    file_sha256,
    folder_sha256,
    local_path,
    read_texts,
    resolve_ref,
)
from stages.errors import ErrorCode, ItoError

PROV = DataProvenance(source="test", license="MIT")


def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    (root / "sub" / "b.txt").write_text("three\n\nfour\n", encoding="utf-8")
    pq.write_table(pa.table({"text": ["five", "six"]}), root / "sub" / "c.parquet")
    (root / "LICENSE").write_text("not data", encoding="utf-8")
    return root


def test_file_and_folder_digests_follow_the_dataref_rule(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    a = root / "a.jsonl"
    assert file_sha256(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    lines = sorted(
        f"{rel}\t{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n"
        for rel in ("a.jsonl", "sub/b.txt", "sub/c.parquet")
    )
    expected = hashlib.sha256("".join(lines).encode()).hexdigest()
    assert folder_sha256(root) == expected
    (root / "LICENSE").write_text("changed", encoding="utf-8")  # not a data file
    assert folder_sha256(root) == expected
    (root / "sub" / "b.txt").rename(root / "sub" / "b2.txt")  # a rename changes it
    assert folder_sha256(root) != expected


def test_resolve_folder_ref_reads_every_format(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    ref = DataRef(uri=f"file://{root}", sha256=folder_sha256(root), provenance=PROV)
    resolved = resolve_ref(ref)
    assert resolved.digest_ok
    assert [f.relpath for f in resolved.files] == ["a.jsonl", "sub/b.txt", "sub/c.parquet"]
    texts = [t for f in resolved.files for t in read_texts(f.path, f.format)]
    assert texts == ["one", "two", "three", "four", "five", "six"]
    wrong = DataRef(uri=f"file://{root}", sha256="0" * 64, provenance=PROV)
    assert not resolve_ref(wrong).digest_ok


@pytest.mark.parametrize(
    "uri",
    [
        "hf://datasets/openai/gsm8k",
        "s3://bucket/x.jsonl",
        "gs://bucket/x",
        "https://example.com/x.jsonl",
    ],
)
def test_remote_refs_refused_unless_cached(tmp_path: Path, uri: str) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ItoError) as e:
        local_path(uri, cache)
    assert e.value.code == ErrorCode.data_remote_not_cached
    scheme, rest = uri.split("://", 1)
    placed = cache / scheme / rest
    placed.parent.mkdir(parents=True, exist_ok=True)
    placed.write_text('{"text": "cached"}\n', encoding="utf-8")
    assert local_path(uri, cache) == placed.resolve()


def test_bad_uris(tmp_path: Path) -> None:
    for uri, code in [
        ("ftp://host/x", ErrorCode.data_scheme_not_allowed),
        (f"file://{tmp_path}/missing.jsonl", ErrorCode.data_not_found),
        ("file://relative/x.jsonl", ErrorCode.data_scheme_not_allowed),
        ("hf://../../etc/passwd", ErrorCode.data_remote_not_cached),
    ]:
        with pytest.raises(ItoError) as e:
            local_path(uri, tmp_path)
        assert e.value.code == code, uri


def test_jsonl_without_the_text_field_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(ItoError) as e:
        list(read_texts(p, "jsonl", "text"))
    assert e.value.code == ErrorCode.data_format_unsupported and "x.jsonl:1" in e.value.message
