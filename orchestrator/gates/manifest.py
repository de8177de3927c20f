"""The training manifest: a strict model, a digest of its exact bytes, a secret scan.

The scan runs over the decoded JSON before the model sees it (so no validation
message can echo a secret) and refuses anything that looks like a credential. A
refused secret is never echoed: messages name only a sanitised JSON path and the
kind of finding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError

from orchestrator.redact import value_kind as _value_kind
from stages.base import StrictModel
from stages.checkpointing.config import CheckpointPolicy
from stages.curriculum.config import CurriculumConfig
from stages.data_prep.config import DataPrepConfig, DataRef
from stages.errors import ErrorCode, ItoError
from stages.post_training.config import PostTrainingConfig
from stages.replica_sync import ReplicaSync
from stages.trainer.config import LossSpikeConfig, ModelSpec, TrainingTarget


class Budget(StrictModel):
    # Finite only: a NaN ceiling would make every comparison false, i.e. no budget.
    ceiling_usd: float = Field(
        gt=0,
        le=1e10,
        allow_inf_nan=False,
        description="estimated cost of the run must not exceed it",
    )
    max_incremental_cost_usd: float = Field(
        ge=0,
        le=1e10,
        allow_inf_nan=False,
        description="spend beyond what the booking's remaining term already covers",
    )


class Manifest(StrictModel):
    manifest_version: Literal[1]
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    model: ModelSpec
    data: DataPrepConfig
    training: TrainingTarget
    curriculum: CurriculumConfig
    post_training: PostTrainingConfig = Field(default_factory=PostTrainingConfig)
    budget: Budget
    checkpoint: CheckpointPolicy
    loss_spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig)
    # How the replica groups sync, pinned: every_step, or diloco with its sync_every
    # (and fragments). None: the planner chooses from the booking's fabric.
    sync: ReplicaSync | None = None

    def data_refs(self) -> list[tuple[str, DataRef]]:
        """Every data reference in the manifest, with where it sits."""
        refs = [(f"data.refs[{i}]", r) for i, r in enumerate(self.data.refs)]
        for stage in ("sft", "dpo", "rlvr"):
            cfg = getattr(self.post_training, stage)
            if cfg is not None:
                refs.append((f"post_training.{stage}.data", cfg.data))
        return refs


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def manifest_id(manifest_digest: str) -> str:
    return "mf_" + manifest_digest[:24]


# --- secret scan --------------------------------------------------------------------
_SECRET_KEY = re.compile(
    r"pass(word|wd|phrase)?$|^pwd$|secret|credential|api[_-]?key|access[_-]?key|"
    r"private[_-]?key|auth[_-]?token|(^|[_-])token$|^bearer$|session[_-]?key|cookie",
    re.IGNORECASE,
)
_SAFE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class SecretFinding:
    path: str
    kind: str


def _safe_key(key: str) -> str:
    return key if _SAFE_KEY.match(key) and _value_kind(key) is None else "?"


def find_secrets(node: object, path: str = "$") -> list[SecretFinding]:
    """Secret-shaped keys and values anywhere in decoded JSON (paths are sanitised)."""
    found: list[SecretFinding] = []
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{_safe_key(key)}"
            if _SECRET_KEY.search(key):
                found.append(SecretFinding(sub, "secret_field"))
            elif _value_kind(key):
                found.append(SecretFinding(sub, "secret_in_key"))
            found.extend(find_secrets(value, sub))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(find_secrets(item, f"{path}[{i}]"))
    elif isinstance(node, str):
        kind = _value_kind(node)
        if kind:
            found.append(SecretFinding(path, kind))
    return found


MAX_DEPTH = 32  # the real schema nests 5 deep
# The schema's largest integer bound (1e10 dollars, 1e15 tokens) has 16 digits; 32
# leaves room and refuses before int() runs, which is quadratic in the digits (Python
# itself refuses past 4300 digits with a ValueError, i.e. a 500 before this check).
MAX_INT_DIGITS = 32


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ItoError(
            ErrorCode.manifest_invalid,
            f"manifest has an integer of more than {MAX_INT_DIGITS} digits",
        )
    return int(text)


# Values (objects, arrays, scalars) in one manifest. A real one has a few thousand
# (256 data refs at most); a megabyte of ``[],[],...`` has 350k, and walking, scanning
# and validating those cost tens of seconds of CPU per request.
MAX_VALUES = 20_000


def _check_shape(node: object) -> None:
    """Nesting depth and value count, iteratively (a hostile document must not blow
    the stack), stopping at the first bound crossed."""
    stack, count = [(node, 1)], 1
    while stack:
        item, d = stack.pop()
        if d > MAX_DEPTH:
            raise ItoError(ErrorCode.manifest_invalid, f"manifest nests deeper than {MAX_DEPTH}")
        if isinstance(item, dict | list):
            count += len(item)  # counted before they are pushed: a huge array costs nothing
            if count > MAX_VALUES:
                raise ItoError(
                    ErrorCode.manifest_invalid, f"manifest has more than {MAX_VALUES} values"
                )
            stack.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        # Two readers of an ambiguous manifest could disagree on what was reviewed.
        raise ItoError(ErrorCode.manifest_invalid, "manifest has a duplicated key")
    return dict(pairs)


def _safe_errors(e: ValidationError) -> tuple[ErrorCode, str]:
    """Validation messages from location and message only: never the input value."""
    parts, code = [], ErrorCode.manifest_invalid
    for err in e.errors(include_input=False, include_url=False)[:5]:
        loc = ".".join(
            str(x) if isinstance(x, int) or _SAFE_KEY.match(str(x)) else "?" for x in err["loc"]
        )
        if err["type"] == "missing" and err["loc"] and err["loc"][-1] == "provenance":
            code = ErrorCode.data_provenance_missing
        parts.append(f"{loc or '$'}: {err['msg']}")
    return code, "; ".join(parts)


@dataclass(frozen=True)
class ParsedManifest:
    raw: bytes
    digest: str
    manifest_id: str
    model: Manifest


def decode_b64(manifest_b64: str, max_bytes: int) -> bytes:
    if len(manifest_b64) > (max_bytes * 4) // 3 + 8:
        raise ItoError(ErrorCode.manifest_too_large, f"manifest exceeds {max_bytes} bytes")
    try:
        raw = base64.b64decode(manifest_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ItoError(ErrorCode.manifest_invalid, "manifest_b64 is not valid base64") from None
    if len(raw) > max_bytes:
        raise ItoError(ErrorCode.manifest_too_large, f"manifest exceeds {max_bytes} bytes")
    return raw


def parse_manifest(raw: bytes, claimed_digest: str | None = None) -> ParsedManifest:
    """Digest check, secret scan, then the strict model. Each failure its own code."""
    actual = digest(raw)
    if claimed_digest is not None and claimed_digest.lower() != actual:
        raise ItoError(
            ErrorCode.manifest_digest_mismatch,
            "manifest_digest does not match the sha256 of the manifest bytes",
        )
    try:
        text = raw.decode("utf-8")
        tree = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ItoError(ErrorCode.manifest_invalid, "manifest is not UTF-8 JSON") from None
    except RecursionError:
        raise ItoError(ErrorCode.manifest_invalid, "manifest nests too deeply") from None
    # Also scan the raw text: a secret split across escapes still shows up decoded,
    # and one in an invalid field never reaches the model.
    _check_shape(tree)
    findings = find_secrets(tree)
    if not findings and _value_kind(text):
        findings = [SecretFinding("$", _value_kind(text) or "secret")]
    if findings:
        where = ", ".join(f"{f.path} ({f.kind})" for f in findings[:5])
        raise ItoError(
            ErrorCode.manifest_contains_secret,
            f"manifest refused: secret-like content at {where}; "
            "reference secrets through the platform, never inline",
        )
    if not isinstance(tree, dict):
        raise ItoError(ErrorCode.manifest_invalid, "manifest must be a JSON object")
    try:
        model = Manifest.model_validate_json(raw)
    except ValidationError as e:
        code, message = _safe_errors(e)
        raise ItoError(code, f"manifest invalid: {message}") from None
    return ParsedManifest(raw, actual, manifest_id(actual), model)
