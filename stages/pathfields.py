"""Path fields: every manifest field that names a file or folder, marked where it is declared.

A config model declares a path field as ``Annotated[<type>, PathField(...)]``: the marker
says which of the account's roots the path must lie in, whether it names a file or a
folder, and how it is written. ``path_values`` walks any model instance and yields every
marked value with where it sits, so the submit-time gate (``orchestrator/gates/roots.py``)
and the stages' run-time checks iterate one enumeration: a field added later is checked
once it carries the marker, and ``tests/api/test_path_fields.py`` fails on a path-like
field without one.

``local_path`` is the lexical half of every check, the same at submit and at run time:
an absolute local path (or ``file://`` URI) is returned; a relative path, a hub id or a
URI of another scheme is ``path_not_local`` (or the field's own code), said without
echoing the value.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel

from stages.errors import ErrorCode, ItoError

REMOTE_SCHEMES = ("hf", "s3", "gs", "http", "https")
RootKind = Literal["data", "checkpoint", "model"]
ROOT_WORDS: dict[str, str] = {
    "data": "data",
    "checkpoint": "checkpoint",
    "model": "data or checkpoint",
}


@dataclass(frozen=True)
class PathField:
    """How one manifest field names a path."""

    # Which of the account's roots: "model" folders may sit in the data or the
    # checkpoint roots (a previous run's HF export lives in the checkpoint root).
    roots: RootKind
    want: Literal["file", "dir", "any"]
    # "file_uri": only file:///abs; "path": only /abs; "either": both.
    form: Literal["file_uri", "path", "either"] = "either"
    # hf://, s3://, ... are resolved from the local cache, never fetched (data refs).
    remote: bool = False
    # Must exist at submit (inside the roots); else a missing one is checked at run time.
    exists: bool = False
    # Files a folder must hold, checked inside the roots only (never outside: no leak).
    contains: tuple[str, ...] = ()
    # The code for a folder inside the roots that is missing or lacks ``contains``.
    invalid: ErrorCode = ErrorCode.data_not_found
    # The code for a value that is not an absolute local path, and for one that is not
    # canonical (``..``, ``//``): the storage folder has its own code for both.
    not_local: ErrorCode = ErrorCode.path_not_local
    not_canonical: ErrorCode = ErrorCode.path_outside_root


def outside(where: str, roots: RootKind = "data") -> ItoError:
    """The one refusal for a path that leaves its roots: it names the manifest field
    only, never a path, a digest or whether anything exists."""
    return ItoError(
        ErrorCode.path_outside_root,
        f"{where} is not inside this account's {ROOT_WORDS[roots]} roots",
    )


def file_uri_path(uri: str, where: str, roots: RootKind = "data") -> str:
    """The path of a local ``file://`` URI; another host, a query or a fragment is
    refused like any path outside the roots."""
    try:
        parsed = urlsplit(uri)
    except ValueError:
        raise outside(where, roots) from None
    if (
        parsed.scheme.lower() != "file"
        or parsed.netloc not in ("", "localhost")
        or parsed.query
        or parsed.fragment
    ):
        raise outside(where, roots)
    return unquote(parsed.path)


def _scheme(raw: str) -> str:
    if "://" not in raw:
        return ""
    try:
        return urlsplit(raw).scheme.lower()
    except ValueError:
        return "?"


def local_path(raw: str, spec: PathField, where: str) -> str | None:
    """The absolute local path ``raw`` names, or None for a remote ref the cache
    resolves. Not canonicality: the walk (``stages/safepath.py``) refuses ``..``."""
    scheme = _scheme(raw)
    if scheme == "file" and spec.form != "path":
        return file_uri_path(raw, where, spec.roots)
    if scheme and spec.remote:
        return None  # the data policy gate answers for the scheme
    if not scheme and spec.form != "file_uri" and raw.startswith("/"):
        return raw
    form = {
        "file_uri": "a file:///absolute URI",
        "path": "an absolute path",
        "either": "an absolute path or file:/// URI",
    }[spec.form]
    raise ItoError(
        spec.not_local,
        f"{where} must be {form} inside this account's {ROOT_WORDS[spec.roots]} "
        "roots; hub ids, remote URIs and relative paths are not read",
    )


def field_spec(model: type[BaseModel], name: str) -> PathField | None:
    info = model.model_fields[name]
    return next((m for m in info.metadata if isinstance(m, PathField)), None)


def path_values(obj: BaseModel, prefix: str = "") -> Iterator[tuple[str, str, PathField]]:
    """(where, value, spec) of every set path field below ``obj``, in field order."""
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        where = f"{prefix}{name}"
        spec = field_spec(type(obj), name)
        if spec is not None:
            if isinstance(value, str):
                yield where, value, spec
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    yield f"{where}[{i}]", item, spec
            continue
        if isinstance(value, BaseModel):
            yield from path_values(value, f"{where}.")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from path_values(item, f"{where}[{i}].")
