"""Valid manifests with correct shapes, written safely (0600, owned by the caller)."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "manifests" / "example.json"


def example_manifest(checkpoint_dir: Path | str | None = None, **sections: Any) -> dict[str, Any]:
    """configs/manifests/example.json as a dict; ``checkpoint_dir`` sets the storage uri
    (use a tmp dir), keyword sections replace top-level sections (``budget={...}``)."""
    m: dict[str, Any] = json.loads(EXAMPLE.read_text())
    if checkpoint_dir is not None:
        m["checkpoint"]["storage_uri"] = "file://" + str(Path(checkpoint_dir).resolve())
    for k, v in sections.items():
        m[k] = copy.deepcopy(v)
    return m


def manifest_bytes(m: dict[str, Any] | bytes) -> bytes:
    return m if isinstance(m, bytes) else json.dumps(m, indent=2, sort_keys=True).encode()


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def manifest_payload(m: dict[str, Any] | bytes) -> dict[str, str]:
    """``{manifest_b64, manifest_digest}`` for a request body."""
    raw = manifest_bytes(m)
    return {"manifest_b64": b64(raw), "manifest_digest": digest(raw)}


def write_manifest(path: Path, m: dict[str, Any] | bytes, mode: int = 0o600) -> Path:
    """Write a manifest file the client accepts: regular, 0600, owned by us; returns the
    canonical absolute path."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(manifest_bytes(m))
    os.chmod(path, mode)
    return path
