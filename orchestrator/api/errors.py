"""The handlers that make every failure an envelope with its code's HTTP status."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.api.envelope import fail_body
from stages.errors import ErrorCode, ItoError

log = logging.getLogger("ito.api")
E = ErrorCode


def status_of(code: ErrorCode | str) -> int:
    """The status each code carries (stages/errors.py); 500 for a string that is no code."""
    try:
        return ErrorCode(code).http_status
    except ValueError:
        return 500


def error_response(
    code: ErrorCode | str, message: str, notice: str = "", retry_after_s: object = None
) -> JSONResponse:
    status = status_of(code)
    headers = {"WWW-Authenticate": 'Bearer realm="ito"'} if status == 401 else {}
    if isinstance(retry_after_s, int | float) and status in (429, 503):
        # When to try again: a refusal for load or an outage is not the client's fault.
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return JSONResponse(fail_body(code, message, notice), status_code=status, headers=headers)


def ito_response(exc: ItoError) -> JSONResponse:
    return error_response(exc.code, exc.message, retry_after_s=exc.details.get("retry_after_s"))


def _validation_message(exc: RequestValidationError) -> str:
    """Where and what, never the offending input (it could be a secret)."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if isinstance(x, str | int))
        parts.append(f"{loc[:120]}: {str(err.get('msg', 'invalid'))[:200]}")
    return "; ".join(parts) or "invalid request"


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ItoError)
    async def _ito(_: Request, exc: ItoError) -> JSONResponse:
        return ito_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(E.validation_error, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {
            404: E.not_found,
            405: E.method_not_allowed,
            413: E.payload_too_large,
            429: E.rate_limited,
        }.get(exc.status_code, E.bad_request)
        if exc.status_code >= 500:
            code = E.internal_error
        message = {404: "no such route", 405: "method not allowed on this route"}.get(
            exc.status_code, "request refused"
        )
        resp = JSONResponse(fail_body(code, message), status_code=exc.status_code)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ItoError):  # raised in a middleware (outside the handler above)
            return ito_response(exc)
        # Log the type and traceback for operators; the tenant gets a stable code only.
        log.error("unhandled %s", type(exc).__name__, exc_info=exc)
        return error_response(E.internal_error, "internal error")
