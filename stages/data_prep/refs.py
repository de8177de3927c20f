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
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

from stages import safepath
from stages.data_prep.config import DataRef
from stages.errors import ErrorCode, ItoError
from stages.pathfields import file_uri_path, outside
from stages.snapshot import snapshot

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
    files = [
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix in DATA_SUFFIXES and not p.name.startswith(".")
    ]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def folder_sha256(folder: str | Path) -> str:
    """sha256 of the sorted lines "<relative path>\\t<file sha256>\\n" of every data file
    under ``folder`` (DataRef's folder rule)."""
    root = Path(folder)
    lines = sorted(
        f"{p.relative_to(root).as_posix()}\t{file_sha256(p)}\n" for p in data_files(root)
    )
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()


def path_sha256(path: str | Path) -> str:
    p = Path(path)
    return folder_sha256(p) if p.is_dir() else file_sha256(p)


def check_inside(
    path: str, roots: Sequence[str], where: str, *, want: str = "any", allow_missing: bool = False
) -> tuple[int | None, bool]:
    """Open ``path`` inside ``roots`` with the safe walk; ``(fd or None, is_dir)``.

    Everything that is not a plain file or folder reached without a symlink below a
    root is ``path_outside_root``; a missing one is ``data_not_found`` (or ``(None,
    False)`` with ``allow_missing``), said without the path."""
    try:
        fd, st = safepath.open_inside(
            path,
            roots,
            want=want,  # type: ignore[arg-type]
            allow_missing=allow_missing,
        )
    except safepath.WalkError as e:
        if e.kind == "missing":
            raise ItoError(ErrorCode.data_not_found, f"{where}: no such file or folder") from None
        raise outside(where) from None
    except OSError:
        raise outside(where) from None
    return fd, bool(st is not None and stat.S_ISDIR(st.st_mode))


def is_data(rel: str) -> bool:
    """A data file by DataRef's folder rule (its suffix; no hidden files)."""
    name = rel.rsplit("/", 1)[-1]
    return Path(name).suffix in DATA_SUFFIXES and not name.startswith(".")


def _cached_path(uri: str, cache_dir: Path, where: str) -> str:
    """Where a remote ref's local copy sits below a tenant's cache folder (lexically:
    the walk, not ``resolve()``, decides what is reached)."""
    parsed = urlparse(uri)
    rel = (parsed.netloc + unquote(parsed.path)).strip("/")
    if not rel:
        raise outside(where)
    return f"{str(cache_dir).rstrip('/')}/{parsed.scheme.lower()}/{rel}"


def _resolve_inside(
    ref: DataRef, roots: Sequence[str], where: str, copy_to: Path, cache_dir: Path | None
) -> ResolvedRef:
    """resolve_ref under data roots: every file is reached by the safe walk (a symlink
    anywhere below the ref is refused) and copied from its own descriptor into the
    run's ``copy_to``, hashed as copied; the stage reads only the copies, so what the
    digests were checked on is what is read (stages/snapshot.py). A remote ref is read
    the same way from the tenant's cache folder."""
    if cache_dir is None:
        path = file_uri_path(ref.uri, where)
        snap = snapshot(path, roots, copy_to, where, include=is_data)
    else:
        path = _cached_path(ref.uri, cache_dir, where)
        try:
            snap = snapshot(path, roots, copy_to, where, include=is_data)
        except ItoError as e:
            if e.code != ErrorCode.data_not_found:
                raise
            raise ItoError(
                ErrorCode.data_remote_not_cached,
                f"{where}: remote data is not fetched on booked nodes; place a "
                "copy in the cache folder first",
            ) from None
    if snap.is_dir and not snap.files:
        raise ItoError(ErrorCode.data_empty, f"{where}: no data files in the folder")
    assert snap.path is not None
    files = [
        DataFile(
            snap.path / f.relpath if snap.is_dir else snap.path,
            f.relpath,
            file_format(Path(f.relpath), ref.format),
            f.sha256,
            f.bytes,
            origin=f"{path}/{f.relpath}" if snap.is_dir else path,
        )
        for f in snap.files
    ]
    return ResolvedRef(ref, Path(path), files, snap.sha256)


def local_path(uri: str, cache_dir: Path | None = None) -> Path:
    """The local file or folder a URI names; refuses what is not here."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ItoError(
                ErrorCode.data_scheme_not_allowed, f"file URI with a host is not local: {uri}"
            )
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
        raise ItoError(
            ErrorCode.data_remote_not_cached,
            f"{scheme}:// data is not fetched on booked nodes; place a copy at "
            f"{cache / scheme / rel} first",
            details={"uri": uri, "cache_path": str(cache / scheme / rel)},
        )
    raise ItoError(
        ErrorCode.data_scheme_not_allowed,
        f"unsupported data URI scheme {scheme or '(none)'!r}: {uri}",
    )


@dataclass(frozen=True)
class DataFile:
    path: Path
    relpath: str  # relative to the ref's folder, or the file name
    format: str
    sha256: str
    bytes: int
    # Set when ``path`` is the run's private copy of a file found under data roots.
    origin: str | None = None


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
        raise ItoError(
            ErrorCode.data_format_unsupported,
            f"cannot tell the format of {path.name}; use .jsonl, .parquet, .txt "
            "or set the ref's format",
        )
    return fmt


def resolve_ref(
    ref: DataRef,
    cache_dir: Path | None = None,
    roots: Sequence[str] | None = None,
    where: str = "data ref",
    copy_to: Path | None = None,
) -> ResolvedRef:
    """Find the ref's files and compute their digests (no document is read yet).

    With ``roots`` (the account's data roots, always set for a run) a ``file://`` ref
    must lie inside one of them, reached by the symlink-safe walk, and is copied into
    ``copy_to`` (the run's scratch space) from the descriptors that walk opened."""
    scheme = urlparse(ref.uri).scheme.lower()
    # A tenant's cache folder lies in its roots too; the operator's default cache
    # (cache_dir None) is the server's own.
    if roots is not None and (scheme == "file" or (scheme in REMOTE_SCHEMES and cache_dir)):
        if copy_to is None:
            raise ValueError("a ref under data roots is read from a private copy: copy_to")
        return _resolve_inside(ref, roots, where, copy_to, cache_dir if scheme != "file" else None)
    path = local_path(ref.uri, cache_dir)
    if path.is_dir():
        paths = data_files(path)
        if not paths:
            raise ItoError(ErrorCode.data_empty, f"no data files under {path}")
        files = [
            DataFile(
                p,
                p.relative_to(path).as_posix(),
                file_format(p, ref.format),
                file_sha256(p),
                p.stat().st_size,
            )
            for p in paths
        ]
        lines = sorted(f"{f.relpath}\t{f.sha256}\n" for f in files)
        digest = hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()
    else:
        f = DataFile(
            path, path.name, file_format(path, ref.format), file_sha256(path), path.stat().st_size
        )
        files, digest = [f], f.sha256
    return ResolvedRef(ref, path, files, digest)


def _open(path: Path, roots: Sequence[str] | None, binary: bool = False) -> IO:  # type: ignore[type-arg]
    if roots is None:
        return open(path, "rb") if binary else open(path, encoding="utf-8")
    fd, _ = check_inside(str(path), roots, "data file", want="file")
    assert fd is not None
    return os.fdopen(fd, "rb") if binary else os.fdopen(fd, encoding="utf-8")


def read_texts(
    path: Path, fmt: str, text_field: str = "text", roots: Sequence[str] | None = None
) -> Iterator[str]:
    """Documents of one file: a jsonl/parquet field, or one non-empty line of text.
    With ``roots`` the file is opened by the safe walk inside them."""
    if fmt == "parquet":  # only the text column, not whole rows
        import pyarrow.parquet as pq

        with _open(path, roots, binary=True) as fb:
            table = pq.read_table(fb)
        if text_field not in table.column_names:
            raise ItoError(
                ErrorCode.data_format_unsupported, f"{path.name}: no column {text_field!r}"
            )
        for value in table.column(text_field).to_pylist():
            if not isinstance(value, str):
                raise ItoError(
                    ErrorCode.data_format_unsupported,
                    f"{path.name}: column {text_field!r} holds a non-string",
                )
            yield value
        return
    for _, text in read_records(path, fmt, text_field, roots):
        yield text


def read_records(
    path: Path, fmt: str, text_field: str = "text", roots: Sequence[str] | None = None
) -> Iterator[tuple[dict[str, Any], str]]:
    """(the caller's record as it was, its text) per document of one file. A text
    file's record is ``{text_field: line}``. With ``roots``, opened by the safe walk."""
    if fmt == "jsonl":
        with _open(path, roots) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    value = record[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ItoError(
                        ErrorCode.data_format_unsupported,
                        f"{path.name}:{lineno}: not a JSON object with a "
                        f"{text_field!r} field ({type(e).__name__})",
                    ) from e
                if not isinstance(value, str):
                    raise ItoError(
                        ErrorCode.data_format_unsupported,
                        f"{path.name}:{lineno}: {text_field!r} is not a string",
                    )
                yield record, value
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        with _open(path, roots, binary=True) as fb:
            table = pq.read_table(fb)
        if text_field not in table.column_names:
            raise ItoError(
                ErrorCode.data_format_unsupported, f"{path.name}: no column {text_field!r}"
            )
        for record in table.to_pylist():
            value = record[text_field]
            if not isinstance(value, str):
                raise ItoError(
                    ErrorCode.data_format_unsupported,
                    f"{path.name}: column {text_field!r} holds a non-string",
                )
            yield record, value
    elif fmt == "text":
        with _open(path, roots) as f:
            for line in f:
                if line.strip():
                    text = line.rstrip("\n")
                    yield {text_field: text}, text
    else:
        raise ItoError(ErrorCode.data_format_unsupported, f"unknown format {fmt!r}")
