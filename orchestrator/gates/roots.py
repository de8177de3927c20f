"""Tenant roots: every data and checkpoint reference stays inside the account's roots.

The operator configures each account's data and checkpoint roots
(``ito-backend accounts roots``, stored in SQLite). At submit (and plan and confirm)
every ``file://`` data reference, eval file, cache folder and the checkpoint storage
is resolved with the same symlink-safe walk the client uses for manifests
(``stages/safepath.py``: canonical path, ``openat`` + ``O_NOFOLLOW`` below the root,
no other host in ``file://``); the data-prep stage resolves them again at run time.
The server's own files (its database files, the run scratch space, the launch key,
Ray's session folders) are refused even where a root would include them.

A refusal is ``path_outside_root`` with a message that names the manifest field
only: never a path, a digest, or whether anything exists. Nothing is created or
written here (no probe file); an ``OSError`` becomes the same refusal, never a 500.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.db.store import Store, is_postgres
from orchestrator.gates.manifest import Manifest
from orchestrator.runtime.launch import launch_key_path
from orchestrator.settings import Settings
from stages import safepath
from stages.data_prep.refs import check_inside, file_uri_path, outside
from stages.errors import ErrorCode, ItoError


@dataclass(frozen=True)
class Roots:
    data: tuple[str, ...]
    checkpoint: tuple[str, ...]
    # Never reachable, whatever the roots say: the server's own state.
    forbidden: tuple[str, ...] = ()


def _real(p: Path | str) -> str:
    return os.path.realpath(str(p))


def account_roots(settings: Settings, store: Store, account_id: str) -> Roots:
    forbidden = {_real(settings.var_dir), _real(launch_key_path()), _real(Path.home() / ".ray")}
    if not is_postgres(settings.db_path):
        db = _real(settings.db_path)
        forbidden |= {db, db + "-wal", db + "-shm", db + "-journal"}
    # Server-wide checkpoint roots (``serve --checkpoint-root``) add to the account's.
    ckpt = (*store.roots(account_id, "checkpoint"),
            *(_real(r) for r in settings.checkpoint_roots))
    return Roots(data=store.roots(account_id, "data"), checkpoint=tuple(dict.fromkeys(ckpt)),
                 forbidden=tuple(sorted(forbidden)))


def _forbidden(path: str, roots: Roots) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in roots.forbidden)


def _check(path: str, allowed: tuple[str, ...], roots: Roots, where: str, want: str) -> None:
    if _forbidden(path, roots):
        raise outside(where)
    try:
        fd, _ = check_inside(path, allowed, where, want=want, allow_missing=True)
    except ItoError as e:
        if e.code == ErrorCode.data_not_found:  # a component exists but not as a folder
            raise outside(where) from None
        raise
    if fd is None:
        return
    try:
        if want == "any" and stat.S_ISDIR(os.fstat(fd).st_mode):
            safepath.check_tree(fd)  # a folder ref: no symlink anywhere below it
    except (safepath.WalkError, OSError):
        raise outside(where) from None
    finally:
        os.close(fd)


def check_data_roots(m: Manifest, roots: Roots) -> None:
    """Every local data reference of the manifest lies inside the data roots.

    A reference that does not exist yet is accepted here (the run checks again and
    answers ``data_not_found``); one that leaves the roots is refused."""
    for where, ref in m.data_refs():
        if urlsplit(ref.uri).scheme.lower() == "file":
            _check(file_uri_path(ref.uri, where), roots.data, roots, where, "any")
    for i, uri in enumerate(m.data.eval_files):
        where = f"data.eval_files[{i}]"
        _check(file_uri_path(uri, where), roots.data, roots, where, "file")
    if m.data.cache_dir is not None:
        _check(m.data.cache_dir, roots.data, roots, "data.cache_dir", "dir")
    if m.post_training.base_model is not None:
        where = "post_training.base_model"
        _check(file_uri_path(m.post_training.base_model, where), roots.data, roots, where, "dir")


def check_checkpoint_roots(m: Manifest, roots: Roots) -> str:
    """The checkpoint storage: canonical, absolute, inside a checkpoint root; every
    part of it that exists already is a folder reached without a symlink."""
    raw = m.checkpoint.storage_path
    try:
        safepath.path_parts(raw)
    except safepath.WalkError:
        raise ItoError(ErrorCode.checkpoint_storage_invalid,
                       "checkpoint storage must be a normalised absolute path") from None
    try:
        _check(raw, roots.checkpoint, roots, "checkpoint.storage_uri", "dir")
    except ItoError as e:
        if e.code == ErrorCode.path_outside_root:
            raise ItoError(ErrorCode.path_outside_root, "checkpoint.storage_uri is not inside "
                           "this account's checkpoint roots") from None
        raise
    return raw
