"""Data refs: resolve URIs to local files, check digests, read documents.

``file:///abs/path`` names a file or a folder of data files. Remote schemes (hf, s3,
gs, http, https) are recognised but never fetched here: a booked node has no
business pulling tenant data from the internet mid-run, so they resolve only to a
copy already placed in the local cache, ``<cache>/<scheme>/<host and path>``
(``ITO_DATA_CACHE`` or ``~/.cache/ito/data``), and are refused otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from stages.data_prep.config import DataRef
from stages.errors import ErrorCode, ItoError

DATA_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".txt": "text", ".text": "text"}
REMOTE_SCHEMES = ("hf", "s3", "gs", "http", "https")
_READ_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    env = os.environ.get("ITO_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ito" / "data"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def data_files(folder: Path) -> list[Path]:
    """Every data file under ``folder`` (by suffix; LICENSE, README etc. are not data),
    sorted by relative path."""
    files = [p for p in folder.rglob("*")
             if p.is_file() and p.suffix in DATA_SUFFIXES and not p.name.startswith(".")]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def folder_sha256(folder: str | Path) -> str:
    """sha256 of the sorted lines "<relative path>\\t<file sha256>\\n" of every data file
    under ``folder`` (DataRef's folder rule)."""
    root = Path(folder)
    lines = sorted(f"{p.relative_to(root).as_posix()}\t{file_sha256(p)}\n"
                   for p in data_files(root))
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()


def path_sha256(path: str | Path) -> str:
    p = Path(path)
    return folder_sha256(p) if p.is_dir() else file_sha256(p)


def local_path(uri: str, cache_dir: Path | None = None) -> Path:
    """The local file or folder a URI names; refuses what is not here."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ItoError(ErrorCode.data_scheme_not_allowed,
                           f"file URI with a host is not local: {uri}")
        path = Path(unquote(parsed.path))
        if not path.is_absolute():
            raise ItoError(ErrorCode.data_not_found, f"file URI must be absolute: {uri}")
        if not path.exists():
            raise ItoError(ErrorCode.data_not_found, f"no such file or folder: {path}")
        return path
    if scheme in REMOTE_SCHEMES:
        cache = cache_dir or default_cache_dir()
        rel = (parsed.netloc + unquote(parsed.path)).strip("/")
        cached = (cache / scheme / rel).resolve()
        if rel and ".." not in Path(rel).parts and cached.exists():
            return cached
        raise ItoError(ErrorCode.data_remote_not_cached,
                       f"{scheme}:// data is not fetched on booked nodes; place a copy at "
                       f"{cache / scheme / rel} first",
                       details={"uri": uri, "cache_path": str(cache / scheme / rel)})
    raise ItoError(ErrorCode.data_scheme_not_allowed,
                   f"unsupported data URI scheme {scheme or '(none)'!r}: {uri}")


@dataclass(frozen=True)
class DataFile:
    path: Path
    relpath: str  # relative to the ref's folder, or the file name
    format: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class ResolvedRef:
    ref: DataRef
    path: Path
    files: list[DataFile]
    sha256: str  # actual digest by DataRef's rule

    @property
    def digest_ok(self) -> bool:
        return self.sha256 == self.ref.sha256


def file_format(path: Path, declared: str | None = None) -> str:
    fmt = declared or DATA_SUFFIXES.get(path.suffix)
    if fmt is None:
        raise ItoError(ErrorCode.data_format_unsupported,
                       f"cannot tell the format of {path.name}; use .jsonl, .parquet, .txt "
                       "or set the ref's format")
    return fmt


def resolve_ref(ref: DataRef, cache_dir: Path | None = None) -> ResolvedRef:
    """Find the ref's files and compute their digests (no document is read yet)."""
    path = local_path(ref.uri, cache_dir)
    if path.is_dir():
        paths = data_files(path)
        if not paths:
            raise ItoError(ErrorCode.data_empty, f"no data files under {path}")
        files = [DataFile(p, p.relative_to(path).as_posix(), file_format(p, ref.format),
                          file_sha256(p), p.stat().st_size) for p in paths]
        lines = sorted(f"{f.relpath}\t{f.sha256}\n" for f in files)
        digest = hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()
    else:
        f = DataFile(path, path.name, file_format(path, ref.format), file_sha256(path),
                     path.stat().st_size)
        files, digest = [f], f.sha256
    return ResolvedRef(ref, path, files, digest)


def read_texts(path: Path, fmt: str, text_field: str = "text") -> Iterator[str]:
    """Documents of one file: a jsonl/parquet field, or one non-empty line of text."""
    if fmt == "parquet":  # only the text column, not whole rows
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ItoError(ErrorCode.data_format_unsupported,
                           f"{path.name}: no column {text_field!r}")
        for value in table.column(text_field).to_pylist():
            if not isinstance(value, str):
                raise ItoError(ErrorCode.data_format_unsupported,
                               f"{path.name}: column {text_field!r} holds a non-string")
            yield value
        return
    for _, text in read_records(path, fmt, text_field):
        yield text


def read_records(path: Path, fmt: str,
                 text_field: str = "text") -> Iterator[tuple[dict[str, Any], str]]:
    """(the caller's record as it was, its text) per document of one file. A text
    file's record is ``{text_field: line}``."""
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    value = record[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ItoError(ErrorCode.data_format_unsupported,
                                   f"{path.name}:{lineno}: not a JSON object with a "
                                   f"{text_field!r} field ({type(e).__name__})") from e
                if not isinstance(value, str):
                    raise ItoError(ErrorCode.data_format_unsupported,
                                   f"{path.name}:{lineno}: {text_field!r} is not a string")
                yield record, value
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ItoError(ErrorCode.data_format_unsupported,
                           f"{path.name}: no column {text_field!r}")
        for record in table.to_pylist():
            value = record[text_field]
            if not isinstance(value, str):
                raise ItoError(ErrorCode.data_format_unsupported,
                               f"{path.name}: column {text_field!r} holds a non-string")
            yield record, value
    elif fmt == "text":
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    text = line.rstrip("\n")
                    yield {text_field: text}, text
    else:
        raise ItoError(ErrorCode.data_format_unsupported, f"unknown format {fmt!r}")
