"""API keys: issued once, stored as sha256 only, resolved to an account and scopes.

Authentication is identity, not authority: a valid key never replaces a
confirmation. Keys look like ``itok_<key_id>_<secret>``; only the hash of the
whole key is stored, so the key cannot be recovered from the database.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from orchestrator.db.store import Store
from stages.errors import ErrorCode, ItoError

SCOPES = (
    "runs:read",
    "runs:write",
    "confirm:train",
    "confirm:cancel",
    "confirm:cleanup",
    "confirm:release",
    "confirm:restart",
)
KEY_PREFIX = "itok_"


def sha256_hex(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass(frozen=True)
class Principal:
    account_id: str
    key_id: str
    scopes: frozenset[str]
    # The account's name (names never change): a run's view needs no lookup of its own.
    account_name: str

    def require(self, scope: str, *alternatives: str) -> None:
        """The key must hold ``scope`` or one of ``alternatives``."""
        wanted = (scope, *alternatives)
        if not any(s in self.scopes for s in wanted):
            raise ItoError(
                ErrorCode.forbidden_scope, f"this key lacks the {' or '.join(wanted)} scope"
            )


def issue_key(store: Store, account_name: str, scopes: list[str]) -> tuple[str, str]:
    """Create a key for ``account_name``; returns (key_id, key). The key is shown once."""
    bad = sorted(set(scopes) - set(SCOPES))
    if bad or not scopes:
        raise ItoError(
            ErrorCode.bad_request, f"unknown or no scopes {bad}; known: {', '.join(SCOPES)}"
        )
    account = store.account_by_name(account_name)
    if account is None:
        raise ItoError(ErrorCode.not_found, f"no account {account_name!r}")
    key_id = secrets.token_hex(8)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    store.insert_key(key_id, account["account_id"], sha256_hex(key), scopes)
    return key_id, key


def authenticate(store: Store, authorization: str | None) -> Principal:
    """Resolve ``Authorization: Bearer <key>``; unknown keys and revoked keys differ."""
    if not authorization or not authorization.startswith("Bearer "):
        raise ItoError(ErrorCode.unauthenticated, "an API key is required (Bearer)")
    key = authorization.removeprefix("Bearer ").strip()
    if not key.startswith(KEY_PREFIX) or len(key) > 256:
        raise ItoError(ErrorCode.unauthenticated, "invalid API key")
    digest = sha256_hex(key)
    row = store.key_by_hash(digest)
    # The lookup is by hash; compare again in constant time for good measure.
    if row is None or not hmac.compare_digest(row["key_sha256"], digest):
        raise ItoError(ErrorCode.unauthenticated, "invalid API key")
    if row["revoked_at"] is not None:
        raise ItoError(ErrorCode.credential_revoked, "this API key was revoked")
    if row["account_name"] is None or row["account_disabled_at"] is not None:
        raise ItoError(ErrorCode.account_disabled, "this API key's account is disabled")
    return Principal(
        row["account_id"], row["key_id"], frozenset(row["scopes"].split()), row["account_name"]
    )
