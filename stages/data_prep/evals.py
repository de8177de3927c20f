"""Eval suites: named sets of eval files, described by ``configs/evals/<suite>.json``.

A suite file looks like::

    {"name": "gsm8k", "description": "...", "license": "MIT",
     "files": [{"path": "gsm8k/test.jsonl", "field": "question"}]}

``path`` is relative to ``configs/evals/``; ``field`` names the text of an item in a
jsonl file (plain ``.txt`` files hold one item a line). Decontamination matches
training documents against these items; the curriculum's eval battery and the ladder
probe's held-out text read the same registry.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.data_prep.refs import check_inside, file_sha256, local_path
from stages.errors import ErrorCode, ItoError
from stages.pathfields import file_uri_path
from stages.presets import configs_dir, list_configs


class EvalFileSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    field: str = "question"
    answer_field: str | None = None


class EvalSuite(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str = ""
    license: str = ""
    files: list[EvalFileSpec] = Field(min_length=1)
    # An eval battery (stages.evals) is a suite with checks: its items are
    # decontaminated against like any suite's; the checks are read by stages.evals.
    checks: list[dict[str, Any]] = Field(default_factory=list)


@dataclass(frozen=True)
class EvalItem:
    suite: str
    file: str
    index: int  # 0-based item number within its file
    text: str
    answer: str | None = None  # the suite's answer_field, for eval batteries that score


@dataclass(frozen=True)
class EvalFileInfo:
    suite: str
    path: str
    sha256: str
    items: int


def evals_dir() -> Path:
    return configs_dir() / "evals"


def list_eval_suites() -> list[str]:
    """Suites with items to decontaminate against (a battery of held-out checks only
    names no file, and is no suite)."""
    return list_configs("evals", EvalSuite)


def load_eval_suite(name: str) -> EvalSuite:
    path = evals_dir() / f"{name}.json"
    if "/" in name or not path.is_file():
        raise ItoError(
            ErrorCode.eval_suite_unknown,
            f"unknown eval suite {name!r}; known: {', '.join(list_eval_suites())}",
        )
    try:
        return EvalSuite.model_validate_json(path.read_bytes())
    except ValueError as e:
        raise ItoError(
            ErrorCode.eval_suite_unknown, f"{name!r} is not an eval suite (no item files)"
        ) from e


def read_eval_file(
    path: Path, field: str, suite: str, answer_field: str | None = None
) -> list[EvalItem]:
    """Items of one eval file: jsonl with a text ``field`` (and optionally an answer),
    or plain text a line each."""
    if not path.is_file():
        raise ItoError(ErrorCode.data_not_found, f"eval file not found: {path}")
    items: list[EvalItem] = []
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if path.suffix == ".jsonl":
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
                text = row[field]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ItoError(
                    ErrorCode.data_format_unsupported,
                    f"{path.name} item {i}: not a JSON object with a {field!r} field",
                ) from e
            answer = row.get(answer_field) if answer_field else None
            items.append(
                EvalItem(suite, str(path), i, str(text), None if answer is None else str(answer))
            )
    else:
        items = [EvalItem(suite, str(path), i, line.rstrip("\n")) for i, line in enumerate(lines)]
    return items


def load_eval_items(
    suites: list[str],
    files: list[str] | None = None,
    field: str = "question",
    roots: Sequence[str] | None = None,
) -> tuple[list[EvalItem], list[EvalFileInfo]]:
    """All items of the named suites plus extra eval files (paths or file:// URIs; their
    suite name is the file's stem)."""
    items: list[EvalItem] = []
    infos: list[EvalFileInfo] = []
    for name in suites:
        suite = load_eval_suite(name)
        for spec in suite.files:
            path = evals_dir() / spec.path
            got = read_eval_file(path, spec.field, suite.name, spec.answer_field)
            items += got
            infos.append(EvalFileInfo(suite.name, str(path), file_sha256(path), len(got)))
    for i, ref in enumerate(files or []):
        if roots is not None:  # a run: a file:// URI inside the data roots, by the safe walk
            where = f"data.eval_files[{i}]"
            fd, _ = check_inside(file_uri_path(ref, where), roots, where, want="file")
            assert fd is not None
            os.close(fd)
        path = local_path(ref) if "://" in ref else Path(ref)
        got = read_eval_file(path, field, path.stem)
        items += got
        infos.append(EvalFileInfo(path.stem, str(path), file_sha256(path), len(got)))
    return items, infos
