"""The one response shape: ``{ok, live_api_contacted, notice, data | error}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from stages.errors import ErrorCode


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: ErrorCode
    message: str


class Envelope(BaseModel):
    """Documented shape of every response body (success or failure)."""

    model_config = ConfigDict(extra="forbid")
    ok: bool
    live_api_contacted: bool = True
    notice: str
    data: dict[str, Any] | None = None
    error: ErrorBody | None = None


def ok(data: dict[str, Any], notice: str = "ok", status: int = 200) -> JSONResponse:
    body = {"ok": True, "live_api_contacted": True, "notice": notice, "data": data}
    return JSONResponse(body, status_code=status)


def fail_body(code: ErrorCode | str, message: str, notice: str = "") -> dict[str, Any]:
    return {
        "ok": False,
        "live_api_contacted": True,
        "notice": notice or f"refused: {code}",
        "error": {"code": str(code), "message": message},
    }
