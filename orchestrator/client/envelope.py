"""The envelope every ``ItoClient`` call returns (docs/api-contract.md): the server's,
or one the client made with ``live_api_contacted: false`` when the server was never
reached; and the codes after which a caller must stop and hand control back."""

from __future__ import annotations

from typing import Any

from stages.errors import ErrorCode

Envelope = dict[str, Any]

# Answers after which polling must stop and hand control back (never re-login).
STOP_POLLING_CODES = frozenset(
    {
        ErrorCode.credential_revoked,
        ErrorCode.unauthenticated,
        ErrorCode.forbidden_scope,
        ErrorCode.account_disabled,
    }
)


def error_envelope(
    code: ErrorCode | str, message: str, *, live_api_contacted: bool = False, notice: str = ""
) -> Envelope:
    return {
        "ok": False,
        "live_api_contacted": live_api_contacted,
        "notice": notice,
        "error": {"code": str(code), "message": message},
    }


def ok_envelope(
    data: dict[str, Any], *, live_api_contacted: bool = True, notice: str = ""
) -> Envelope:
    return {"ok": True, "live_api_contacted": live_api_contacted, "notice": notice, "data": data}


def error_code(env: Envelope) -> str | None:
    err = env.get("error")
    return err.get("code") if isinstance(err, dict) else None


def is_envelope(body: object) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        return False
    if body["ok"]:
        return isinstance(body.get("data"), dict)
    return isinstance(body.get("error"), dict) and isinstance(body["error"].get("code"), str)
