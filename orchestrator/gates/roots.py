"""Tenant roots: every path a manifest names stays inside the account's roots.

The operator configures each account's data and checkpoint roots
(``ito-backend accounts roots``, stored in SQLite). At submit (and plan and confirm)
every path field of the manifest, as the config models mark them
(``stages/pathfields.py``: data refs, eval files, cache and spill folders, the
checkpoint storage, ``model.checkpoint_path``, ``model.tokenizer_path``,
``post_training.base_model``), is resolved with the same symlink-safe walk the client
uses for manifests (``stages/safepath.py``: canonical path, ``openat`` + ``O_NOFOLLOW``
below the root, no other host in ``file://``); a folder is walked whole (a symlink
anywhere below it is refused). The stages resolve them again at run time, with roots
the supervisor gives them, and read what they resolved (``stages/snapshot.py``). The
server's own files (its database files, the run scratch space, the launch key, Ray's
session folders) are refused even where a root would include them.

A path outside the roots is ``path_outside_root`` with a message that names the
manifest field only: never a path, a digest, or whether anything exists (the lexical
check and the walk stop before the target). A relative path or hub id is
``path_not_local``. What a folder inside the roots must hold (``tokenizer.json``,
``config.json``) is checked only there. Nothing is created or written here (no probe
file); an ``OSError`` becomes the same refusal, never a 500.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from orchestrator.db.store import Store, is_postgres
from orchestrator.gates.manifest import Manifest
from orchestrator.settings import Settings
from stages import safepath
from stages.errors import ErrorCode, ItoError
from stages.keys import launch_key_path
from stages.pathfields import PathField, local_path, outside, path_values


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
    ckpt = (*store.roots(account_id, "checkpoint"), *(_real(r) for r in settings.checkpoint_roots))
    return Roots(
        data=store.roots(account_id, "data"),
        checkpoint=tuple(dict.fromkeys(ckpt)),
        forbidden=tuple(sorted(forbidden)),
    )


def _forbidden(path: str, roots: Roots) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in roots.forbidden)


def allowed_roots(spec: PathField, roots: Roots) -> tuple[str, ...]:
    if spec.roots == "data":
        return roots.data
    if spec.roots == "checkpoint":
        return roots.checkpoint
    return tuple(dict.fromkeys((*roots.data, *roots.checkpoint)))


def check_path(where: str, raw: str, spec: PathField, roots: Roots) -> str | None:
    """One path field: the local path it names (None for a remote ref) once it is
    inside its roots, or the field's refusal."""
    path = local_path(raw, spec, where)
    if path is None:
        return None
    try:
        safepath.path_parts(path)
    except safepath.WalkError:
        if spec.not_canonical != ErrorCode.path_outside_root:
            raise ItoError(
                spec.not_canonical, f"{where} must be a normalised absolute path"
            ) from None
        raise outside(where, spec.roots) from None
    if _forbidden(path, roots):
        raise outside(where, spec.roots)
    try:
        fd, st = safepath.open_inside(
            path, allowed_roots(spec, roots), want=spec.want, allow_missing=True
        )
    except (safepath.WalkError, OSError):
        raise outside(where, spec.roots) from None
    if fd is None or st is None:  # inside the roots, not there (yet)
        if spec.exists:
            raise ItoError(spec.invalid, f"{where}: no such folder in the account's roots")
        return path
    try:
        if stat.S_ISDIR(st.st_mode) and spec.want != "file":
            try:
                safepath.check_tree(fd)  # a folder ref: no symlink anywhere below it
            except (safepath.WalkError, OSError):
                raise outside(where, spec.roots) from None
            for name in spec.contains:
                try:
                    ffd, _ = safepath.walk(os.dup(fd), [name], want="file")
                except (safepath.WalkError, OSError):
                    raise ItoError(spec.invalid, f"{where} has no {name}") from None
                if ffd is not None:
                    os.close(ffd)
    finally:
        os.close(fd)
    return path


def check_manifest_paths(m: Manifest, roots: Roots) -> None:
    """Every path field of the manifest lies inside its roots (``check_path``)."""
    for where, raw, spec in path_values(m):
        check_path(where, raw, spec, roots)


def check_post_training_digests(m: Manifest) -> None:
    """A post-training dataset names the digest of its bytes: a placeholder (one digit
    repeated, e.g. all zeros) would pin nothing and is refused before anything reads."""
    for where, ref in m.data_refs():
        if where.startswith("post_training.") and len(set(ref.sha256)) == 1:
            raise ItoError(
                ErrorCode.data_digest_placeholder,
                f"{where}.sha256 is a placeholder; give the sha256 of the data",
            )
