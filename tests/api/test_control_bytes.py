"""NUL and other control characters get 422 validation_error on every route, on
SQLite and PostgreSQL alike, and the refusal is audited. The rule
(orchestrator/api/inputguard.py): identifiers and paths allow no control character;
JSON text allows only tab, newline and carriage return."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from helpers.fixtures import both_engines

from .conftest import Api, code_of

pytestmark = both_engines

REF = {"confirmation_ref": "conf_0000000000000000"}
# (method, URL, key, body): every route that takes an identifier from the path or
# query, with a NUL (percent-encoded) in it.
ROUTES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/bookings/b%00/eligibility", "submitter", None),
    ("POST", "/v1/bookings/b%00/release", "approver", REF),
    ("GET", "/v1/runs?idempotency_key=key%00-0001", "submitter", None),
    ("GET", "/v1/runs/run_%00", "submitter", None),
    ("GET", "/v1/runs/run_%00/logs", "submitter", None),
    ("GET", "/v1/runs/run_1/logs?cursor=1%00", "submitter", None),
    ("GET", "/v1/runs/run_%00/metrics", "submitter", None),
    ("GET", "/v1/runs/run_%00/checkpoints", "submitter", None),
    ("POST", "/v1/runs/run_%00/cancel", "submitter", REF),
    ("POST", "/v1/runs/run_%00/cleanup", "submitter", REF),
    ("POST", "/v1/runs/run_%00/proposals/p_1/approve", "approver", REF),
    ("POST", "/v1/runs/run_1/proposals/p_%00/decline", "approver", REF),
]


def _key(api: Api, who: str) -> str:
    return str(getattr(api.t, who))


def _input_refusals(api: Api) -> int:
    api.client.app.state.ctx.store.flush_counted()  # type: ignore[attr-defined]
    rows = api.store.read(
        "SELECT SUM(count) AS n FROM audit_events WHERE gate = 'input' AND code = ?",
        ("validation_error",),
    )
    return int(rows[0]["n"] or 0)


@pytest.mark.parametrize(("method", "url", "who", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_a_nul_in_a_path_or_query_identifier_is_422_and_audited(
    api: Api, method: str, url: str, who: str, body: dict[str, Any] | None
) -> None:
    r = api.client.request(
        method, url, json=body, headers=api.h(_key(api, who), idem="key-00000001")
    )
    assert r.status_code == 422 and code_of(r) == "validation_error", r.text
    assert "\x00" not in r.text  # the input is never echoed
    assert _input_refusals(api) == 1


@pytest.mark.parametrize("char", ["\x01", "\x1b", "\x7f", "\x85", "\t", "\n"], ids=repr)
def test_every_control_character_in_an_identifier_is_422(api: Api, char: str) -> None:
    r = api.client.get(f"/v1/runs/run_{quote(char)}x", headers=api.h(api.t.submitter))
    assert r.status_code == 422 and code_of(r) == "validation_error", r.text


@pytest.mark.parametrize(
    "body",
    [
        '{"confirmation_ref": "conf_\\u0000"}',
        '{"confirmation_ref": "conf_\\u001b[31m"}',
        '{"confirmation_ref": "conf_\\\\\\u0000"}',  # an escaped backslash, then a NUL
    ],
    ids=["nul", "escape", "after-backslash"],
)
def test_a_c0_control_in_json_text_is_422(api: Api, body: str) -> None:
    r = api.client.post(
        "/v1/runs/run_1/cancel",
        content=body.encode(),
        headers={**api.h(api.t.submitter, "key-00000001"), "Content-Type": "application/json"},
    )
    assert r.status_code == 422 and code_of(r) == "validation_error", r.text


@pytest.mark.parametrize(
    "body",
    [
        '{"confirmation_ref": "conf_\\t\\n\\r"}',  # free text may hold tab and newlines
        '{"confirmation_ref": "conf_\\\\u0000"}',  # the text "\u0000", not a NUL
    ],
    ids=["tab-newline", "escaped-backslash"],
)
def test_tab_newline_and_backslash_text_pass_the_guard(api: Api, body: str) -> None:
    r = api.client.post(
        "/v1/runs/run_1/cancel",
        content=body.encode(),
        headers={**api.h(api.t.submitter, "key-00000001"), "Content-Type": "application/json"},
    )
    # Past the guard: the run does not exist.
    assert r.status_code == 404 and code_of(r) == "run_not_found", r.text


def test_a_nul_in_a_body_identifier_is_422(api: Api) -> None:
    r = api.client.post(
        "/v1/confirmations",
        json={"action": "cancel", "booking_id": "b\x00", "run_id": "run_1", "cost_usd": 0},
        headers=api.h(api.t.approver),
    )
    assert r.status_code == 422 and code_of(r) == "validation_error", r.text


def test_a_control_byte_in_an_identifier_header_is_422(api: Api) -> None:
    r = api.client.post(
        "/v1/runs/run_1/cancel",
        json=REF,
        headers={**api.h(api.t.submitter), "Idempotency-Key": "key-0000\x7f01"},
    )
    assert r.status_code == 422 and code_of(r) == "validation_error", r.text
