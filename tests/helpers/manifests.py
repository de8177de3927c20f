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


def gsm8k_ref(tmp: Path, rows: int = 20) -> dict[str, Any]:
    """A data ref of ``rows`` GSM8K training rows copied under ``tmp``: an RLVR recipe's
    prompts, with their digest and provenance."""
    from stages.data_prep import file_sha256

    path = tmp / "rl.jsonl"
    lines = (REPO / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:rows]
    path.write_text("\n".join(lines) + "\n")
    return {
        "uri": f"file://{path}",
        "sha256": str(file_sha256(path)),
        "role": "custom",
        "format": "jsonl",
        "text_field": "text",
        "provenance": {"source": "test", "license": "MIT"},
    }


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


def data_ref(
    path: Path, role: str = "baseline", *, text_field: str = "text", license: str = "MIT"
) -> dict[str, Any]:
    """A manifest data reference to a local JSONL file, with its digest."""
    from stages.data_prep import file_sha256

    return {
        "uri": f"file://{path}",
        "sha256": str(file_sha256(path)),
        "role": role,
        "format": "jsonl",
        "text_field": text_field,
        "provenance": {"source": "test", "license": license},
    }


# The testbed manifest's checkpoint interval (steps) unless a test names another.
TESTBED_CHECKPOINT_STEPS = 5


def cpu_testbed_manifest(
    refs: list[dict[str, Any]],
    checkpoint_dir: Path,
    *,
    steps: int,
    name: str | None = None,
    interval_steps: int = TESTBED_CHECKPOINT_STEPS,
    keep: int = 2,
    warmup_steps: int = 2,
    **sections: Any,
) -> dict[str, Any]:
    """The manifest the end-to-end tests submit to a CPU-testbed booking: ``llama-tiny``
    on ``refs`` for ``steps`` steps of 512 tokens (sequences of 64), one pretrain phase
    gated by the held-out battery, checkpoints every ``interval_steps`` under
    ``checkpoint_dir``; keyword sections replace top-level sections (``curriculum={...}``,
    ``post_training={...}``)."""
    import uuid

    m: dict[str, Any] = {
        "manifest_version": 1,
        "name": name or f"run-{uuid.uuid4().hex[:6]}",
        "model": {"preset": "llama-tiny", "size": "124K"},
        "data": {"refs": refs, "eval_suites": ["gsm8k"], "ladder_probe": {"enabled": False}},
        "training": {
            "max_steps": steps,
            "seq_len": 64,
            "global_batch_tokens": 512,
            "learning_rate": 0.003,
            "warmup_steps": warmup_steps,
        },
        # Held-out checks only: lm-eval's tasks on the ranks are what the curriculum and
        # demo runs test; here they would cost every run ~6 s of CPU at its phase end.
        "curriculum": {
            "phases": [
                {
                    "name": "pretrain",
                    "kind": "pretrain",
                    "token_fraction": 1.0,
                    "eval_battery": "heldout",
                }
            ]
        },
        "budget": {"ceiling_usd": 50.0, "max_incremental_cost_usd": 50.0},
        "checkpoint": {
            "interval_steps": interval_steps,
            "keep": keep,
            "storage_uri": f"file://{Path(checkpoint_dir).resolve()}",
        },
    }
    m.update(copy.deepcopy(sections))
    return m
