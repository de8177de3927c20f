"""Local post-training datasets in trl's usual formats, checked with clear codes.

- SFT, conversational: ``{"messages": [{"role": "user"|"assistant"|"system", "content": str}]}``
  with at least one assistant turn.
- DPO, preference: ``{"prompt", "chosen", "rejected"}``, either all strings or all
  conversational (prompt a message list, chosen/rejected one assistant message each).
- RLVR, prompt/answer: ``{"prompt": str | messages, "answer": str}`` (GSM8K's
  ``question``/``answer`` is accepted too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from stages.errors import ErrorCode, ItoError

Kind = Literal["sft", "dpo", "rlvr"]
ROLES = ("system", "user", "assistant")
MAX_ROWS = 1_000_000
# One row (one line) at most; a long multi-turn chat is a few hundred kB. Lines are
# read with this cap, so a file without newlines (a sparse gigabyte) costs one cap of
# memory, not the file.
MAX_LINE_BYTES = 4 << 20


def _bad(path: Path, line: int, why: str) -> ItoError:
    return ItoError(ErrorCode.post_training_data_invalid, f"{path.name}:{line}: {why}")


def ref_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    if not path.exists():
        raise ItoError(ErrorCode.data_not_found, f"{path.name}: no such file")
    if path.suffix != ".jsonl":
        raise ItoError(ErrorCode.data_format_unsupported,
                       f"{path.name}: post-training data must be .jsonl")
    return [path]


def _messages(v: Any, path: Path, line: int, field: str) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise _bad(path, line, f"{field} must be a non-empty list of messages")
    for i, m in enumerate(v):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise _bad(path, line, f"{field}[{i}] must have exactly role and content")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise _bad(path, line, f"{field}[{i}]: role must be one of {ROLES}, "
                                   "content a string")
    return v


def _check(kind: Kind, row: Any, path: Path, line: int) -> dict[str, Any]:
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


def iter_rows(kind: Kind, uri: str, *, max_bytes: int | None = None,
              ) -> Iterator[dict[str, Any]]:
    """The dataset's rows, validated, one line at a time (never a whole file in
    memory); stops quietly after ``max_bytes`` of lines when given (the API's bounded
    check; the run reads everything). Raises ItoError on the first bad line."""
    read, rows = 0, 0
    for path in _files(ref_path(uri)):
        with path.open("rb") as f:
            n = 0
            while max_bytes is None or read < max_bytes:
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                n += 1
                read += len(raw)
                if len(raw) > MAX_LINE_BYTES:
                    raise _bad(path, n, f"line longer than {MAX_LINE_BYTES} bytes")
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    # ValueError: also an integer of more than 4300 digits.
                    raise _bad(path, n, "not UTF-8 JSON") from None
                rows += 1
                if rows > MAX_ROWS:
                    raise _bad(path, n, f"more than {MAX_ROWS} rows")
                yield _check(kind, row, path, n)


def load_rows(kind: Kind, uri: str) -> list[dict[str, Any]]:
    """Every row of the dataset, validated; raises ItoError on the first bad line."""
    rows = list(iter_rows(kind, uri))
    if not rows:
        raise ItoError(ErrorCode.data_empty, f"{kind} data has no rows")
    return rows


def check_rows(kind: Kind, uri: str, max_bytes: int) -> int:
    """Validate the first ``max_bytes`` of the dataset; the rows seen (none kept)."""
    rows = sum(1 for _ in iter_rows(kind, uri, max_bytes=max_bytes))
    if not rows:
        raise ItoError(ErrorCode.data_empty, f"{kind} data has no rows")
    return rows
