"""Control characters are refused at the door: 422 ``validation_error`` (pure ASGI).

The rule, one for every route:

* identifiers and paths (the URL path and the query string, after percent-decoding)
  hold no control character at all: C0 (U+0000-U+001F), DEL and C1 (U+0080-U+009F);
  nor do the headers the server reads as identifiers (``Authorization``,
  ``Idempotency-Key``: no C0 or DEL byte, tab included);
* JSON bodies hold no C0 control other than tab, newline and carriage return, raw or
  escaped (``\\u0000``) in any string: free text may span lines, nothing else.

Without it a NUL byte reached the store: SQLite kept it, PostgreSQL refused the
statement (a 500, and the request's audit row was lost with its transaction). The
HTTP parser (h11) already refuses control bytes in header values as malformed HTTP
(400) before any of this runs. A refusal here is audited as a counted row (gate
``input``, code ``validation_error``), never with the offending input.
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote_plus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.api.envelope import fail_body
from orchestrator.db.store import Store
from stages.errors import ErrorCode

# Any control character: C0, DEL and C1 (for identifiers, paths, headers).
_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# A control byte in a header value (UTF-8 bytes are not decoded: C0 and DEL only).
_HEADER_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
# A raw C0 control byte other than tab, newline, carriage return.
_RAW_C0 = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
# A JSON escape of a C0 control (``\u0000``-``\u001f``) preceded by an even number of
# backslashes (an odd number makes the escape's backslash itself escaped text).
_ESCAPED_C0 = re.compile(rb"(?<!\\)(?:\\\\)*\\u00([01][0-9a-fA-F])")
_FREE_TEXT_ESCAPES = {b"09", b"0a", b"0d"}
# The headers the server reads as identifiers.
_ID_HEADERS = (b"authorization", b"idempotency-key")


def control_in_text(value: str) -> bool:
    """Whether an identifier or path holds any control character."""
    return _ANY_CONTROL.search(value) is not None


def control_in_json(raw: bytes) -> bool:
    """Whether JSON text holds a C0 control other than tab, newline or carriage return
    (raw, or escaped in a string)."""
    if _RAW_C0.search(raw):
        return True
    return any(m.group(1).lower() not in _FREE_TEXT_ESCAPES for m in _ESCAPED_C0.finditer(raw))


def _where(scope: Scope) -> str | None:
    """Which part of the request's head holds a control character, if one does."""
    # uvicorn has percent-decoded the path (UTF-8); the query string is decoded here.
    if control_in_text(scope.get("path", "")):
        return "the URL path"
    query = (scope.get("query_string") or b"").decode("latin-1")
    if query and control_in_text(unquote_plus(query)):
        return "the query string"
    for name, value in scope.get("headers") or ():
        if name.lower() in _ID_HEADERS and _HEADER_CONTROL.search(value):
            return f"the {name.decode('latin-1')} header"
    return None


class InputGuard:
    def __init__(self, app: ASGIApp, store: Store):
        self.app, self.store = app, store

    async def _refuse(self, send: Send, where: str) -> None:
        self.store.audit_counted("request", str(ErrorCode.validation_error), gate="input")
        body = json.dumps(
            fail_body(
                ErrorCode.validation_error,
                f"{where} holds a control character (identifiers and paths allow none; "
                "JSON text allows only tab, newline and carriage return)",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 422,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        where = _where(scope)
        if where is not None:
            await self._refuse(send, where)
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        # The body cap (outside) has read the whole body, bounded; scan it, then replay.
        chunks: list[bytes] = []
        while True:
            message: Message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        if control_in_json(body):
            await self._refuse(send, "the request body")
            return

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
