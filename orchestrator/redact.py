"""Secret shapes, and identifiers echoed only when they cannot be a secret.

Light on purpose (no stages, no torch): the store and every route import it.
"""

from __future__ import annotations

import logging
import re

# Every pattern is linear in its input: a literal (or one-character) anchor, then
# bounded repeats only. ``X{12}`` finds the same texts as ``X{12,}`` (only whether a
# match exists matters), and an unbounded run before a literal (the old URI scheme
# ``[A-Za-z][A-Za-z0-9+.-]*://``) re-scans the run from every start: 60 kB of letters
# took seconds and held the GIL, so every tenant's request waited. tests/api
# test_hostile_input.py times each pattern on crafted megabyte inputs.
_SECRET_VALUES: list[tuple[str, re.Pattern[str]]] = [
    ("api_key", re.compile(r"\bsk-[A-Za-z0-9_-]{12}")),
    ("api_key", re.compile(r"\b(ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20}")),
    ("api_key", re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20}")),
    ("api_key", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("api_key", re.compile(r"\bitok_[A-Za-z0-9_-]{8}")),
    ("api_key", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{8}")),
    ("api_key", re.compile(r"\bhf_[A-Za-z0-9]{20}")),
    ("api_key", re.compile(r"\bglpat-[A-Za-z0-9_-]{16}")),
    ("api_key", re.compile(r"\bAIza[0-9A-Za-z_-]{30}")),
    ("bearer_token", re.compile(r"\bbearer\s{1,16}[A-Za-z0-9._~+/=-]{8}", re.IGNORECASE)),
    ("private_key", re.compile(r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----")),
    # user:password@ after a scheme; userinfo longer than 256 is not a credential
    # anyone types.
    ("uri_credentials", re.compile(r"(?<=[A-Za-z0-9+.-])://[^/\s@:]{0,256}:[^/\s@]{0,256}@")),
]

_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
REDACTED = "<redacted>"


def value_kind(text: str) -> str | None:
    """The kind of secret ``text`` contains (api_key, bearer_token, ...), or None."""
    for kind, pattern in _SECRET_VALUES:
        if pattern.search(text):
            return kind
    return None


def looks_secret(text: str) -> bool:
    return value_kind(text) is not None


def safe_id(value: str | None) -> str | None:
    """A caller-chosen id for messages and audit rows: itself if id-shaped and not
    credential-shaped, else ``<redacted>``."""
    if value is None:
        return None
    return value if _ID.match(value) and not looks_secret(value) else REDACTED


# Path segments the access log may show: the API's own vocabulary. Anything else (a
# run id, booking id, proposal id, an idempotency key put where a run id goes) is
# replaced, and the query string is never shown.
_ROUTE_WORDS = frozenset(
    {
        "v1",
        "runs",
        "bookings",
        "plans",
        "confirmations",
        "logs",
        "metrics",
        "checkpoints",
        "cancel",
        "cleanup",
        "proposals",
        "approve",
        "decline",
        "release",
        "eligibility",
        "healthz",
        "openapi.json",
        "docs",
        "redoc",
        "events",
        "status",
    }
)


def redact_url(url: str) -> str:
    """``/v1/runs/run_ab12/logs?cursor=3`` -> ``/v1/runs/{id}/logs?{query}``."""
    path, sep, _ = url.partition("?")
    segments = [s if s in _ROUTE_WORDS or s == "" else "{id}" for s in path.split("/")]
    return "/".join(segments)[:256] + ("?{query}" if sep else "")


class AccessLogRedactor(logging.Filter):
    """A filter for ``uvicorn.access``: its records carry (client, method, path,
    http version, status); the path is replaced by ``redact_url(path)``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_url(args[2]), *args[3:])
        return True
