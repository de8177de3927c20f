"""Local post-training datasets in trl's usual formats, checked with clear codes.

- SFT, conversational: ``{"messages": [{"role": "user"|"assistant"|"system", "content": str}]}``
  with at least one assistant turn.
- DPO, preference: ``{"prompt", "chosen", "rejected"}``, either all strings or all
  conversational (prompt a message list, chosen/rejected one assistant message each).
- RLVR, prompt/answer: ``{"prompt": str | messages, "answer": str}`` (GSM8K's
  ``question``/``answer`` is accepted too).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stages.data_prep.refs import is_data
from stages.errors import ErrorCode, ItoError
from stages.pathfields import file_uri_path
from stages.snapshot import InputFile, hash_fd, read_inside, tree_digest

Kind = Literal["sft", "dpo", "rlvr"]
ROLES = ("system", "user", "assistant")
MAX_ROWS = 1_000_000
# One row (one line) at most; a long multi-turn chat is a few hundred kB. Lines are
# read with this cap, so a file without newlines (a sparse gigabyte) costs one cap of
# memory, not the file.
MAX_LINE_BYTES = 4 << 20


def _bad(path: Path, line: int, why: str) -> ItoError:
    return ItoError(ErrorCode.post_training_data_invalid, f"{path.name}:{line}: {why}")


def _messages(v: object, path: Path, line: int, field: str) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise _bad(path, line, f"{field} must be a non-empty list of messages")
    for i, m in enumerate(v):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise _bad(path, line, f"{field}[{i}] must have exactly role and content")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise _bad(path, line, f"{field}[{i}]: role must be one of {ROLES}, content a string")
    return v


def _check(kind: Kind, row: object, path: Path, line: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise _bad(path, line, "each line must be a JSON object")
    if kind == "sft":
        msgs = _messages(row.get("messages"), path, line, "messages")
        if not any(m["role"] == "assistant" for m in msgs):
            raise _bad(path, line, "messages has no assistant turn")
        return {"messages": msgs}
    if kind == "dpo":
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise _bad(path, line, f"missing {', '.join(missing)}")
        p, c, r = row["prompt"], row["chosen"], row["rejected"]
        if all(isinstance(x, str) for x in (p, c, r)):
            return {"prompt": p, "chosen": c, "rejected": r}
        _messages(p, path, line, "prompt")
        for f, v in (("chosen", c), ("rejected", r)):
            if len(_messages(v, path, line, f)) != 1 or v[0]["role"] != "assistant":
                raise _bad(path, line, f"{f} must be one assistant message")
        return {"prompt": p, "chosen": c, "rejected": r}
    prompt = row.get("prompt", row.get("question"))
    answer = row.get("answer")
    if prompt is None or not isinstance(answer, str) or not answer.strip():
        raise _bad(path, line, "needs prompt (or question) and a non-empty answer string")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _bad(path, line, "prompt is empty")
    else:
        _messages(prompt, path, line, "prompt")
    from stages.post_training.rewards import reference_number

    if reference_number(answer) is None:
        raise _bad(path, line, "answer has no number to verify against")
    return {"prompt": prompt, "answer": answer}


@dataclass
class _Scan:
    """What one read of a dataset keeps: rows (or only their count) and a byte budget."""

    keep_rows: bool
    bytes_left: int | None  # None: every byte is read (the run); else the API's cap
    rows: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0
    complete: bool = True


def _parse(kind: Kind, fd: int, path: Path, scan: _Scan) -> InputFile:
    """Validate the rows of one file line by line (each line capped), hashing the very
    bytes parsed; stops quietly when the scan's byte budget is spent."""
    h, size, n = hashlib.sha256(), 0, 0
    with os.fdopen(os.dup(fd), "rb") as f:
        while True:
            if scan.bytes_left is not None and scan.bytes_left <= 0:
                scan.complete = False
                break
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n += 1
            h.update(raw)
            size += len(raw)
            if scan.bytes_left is not None:
                scan.bytes_left -= len(raw)
            if len(raw) > MAX_LINE_BYTES:
                raise _bad(path, n, f"line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                # ValueError: also an integer of more than 4300 digits.
                raise _bad(path, n, "not UTF-8 JSON") from None
            checked = _check(kind, row, path, n)
            scan.count += 1
            if scan.count > MAX_ROWS:
                raise _bad(path, n, f"more than {MAX_ROWS} rows")
            if scan.keep_rows:
                scan.rows.append(checked)
    return InputFile(path.as_posix(), h.hexdigest(), size)


@dataclass(frozen=True)
class Dataset:
    rows: list[dict[str, Any]]  # empty when read with ``keep_rows=False``
    count: int
    # By DataRef's rule, of the bytes the rows were parsed from; None when a byte budget
    # stopped the read before the end (the run, which reads everything, checks it).
    sha256: str | None


def read_dataset(
    kind: Kind,
    uri: str,
    roots: Sequence[str],
    where: str,
    *,
    max_bytes: int | None = None,
    keep_rows: bool = True,
) -> Dataset:
    """The dataset's rows, validated, read by the safe walk inside ``roots``
    (``stages/snapshot.py``) and hashed as parsed, one capped line at a time (never a
    whole file in memory); raises ItoError on the first bad line. With ``max_bytes``
    (the API's bounded check) only that many bytes of rows are read. Of a folder, the
    ``.jsonl`` files are rows; every data file is digested."""
    path = file_uri_path(uri, where) if uri.startswith("file:") else uri
    scan = _Scan(keep_rows=keep_rows, bytes_left=max_bytes)
    files: list[InputFile] = []
    is_dir = False
    for rel, fd, is_dir in read_inside(path, roots, where, include=is_data):
        name = Path(rel)
        if name.suffix == ".jsonl":
            files.append(_parse(kind, fd, name, scan))
        elif not is_dir:
            raise ItoError(
                ErrorCode.data_format_unsupported, f"{where}: post-training data must be .jsonl"
            )
        else:
            files.append(InputFile(rel, *hash_fd(fd)))
    if not scan.count:
        raise ItoError(ErrorCode.data_empty, f"{kind} data has no rows")
    digest: str | None = None
    if scan.complete:
        digest = tree_digest((f.relpath, f.sha256) for f in files) if is_dir else files[0].sha256
    return Dataset(scan.rows, scan.count, digest)


def load_rows(kind: Kind, uri: str) -> list[dict[str, Any]]:
    """The rows of a dataset anywhere on this host (benchmarks, the stage's own tests):
    ``read_dataset`` with the whole file system as the root."""
    return read_dataset(kind, uri, ("/",), "data").rows
