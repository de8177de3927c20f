"""Every response is an envelope; every code is documented; OpenAPI is committed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from orchestrator.api import create_app
from orchestrator.api.errors import status_of
from orchestrator.settings import Settings
from stages.errors import ErrorCode, markdown_table

from .conftest import Api, code_of

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _is_envelope(body: dict) -> bool:
    keys = set(body)
    if body.get("ok") is True:
        return keys == {"ok", "live_api_contacted", "notice", "data"}
    return (
        keys == {"ok", "live_api_contacted", "notice", "error"}
        and set(body["error"]) == {"code", "message"}
        and body["error"]["code"] in set(ErrorCode)
    )


def test_framework_errors_are_envelopes(api: Api) -> None:
    cases = [
        (api.client.get("/no/such/route"), 404, "not_found"),
        (api.client.put("/v1/runs"), 405, "method_not_allowed"),
        (
            api.client.post(
                "/v1/runs", content=b"{not json", headers={"Content-Type": "application/json"}
            ),
            422,
            "validation_error",
        ),
        (
            api.client.post(
                "/v1/confirmations", json={"action": "fly"}, headers=api.h(api.t.approver)
            ),
            422,
            "validation_error",
        ),
        (api.client.get("/v1/runs"), 422, "validation_error"),
        (
            api.client.post("/v1/plans", content=b"x" * 10, headers={"Content-Length": str(10**9)}),
            413,
            "payload_too_large",
        ),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        assert _is_envelope(resp.json()) and code_of(resp) == code


def test_validation_message_never_echoes_input(api: Api) -> None:
    canary = "sk-" + "Q" * 40
    r = api.client.post(
        "/v1/plans", json={"booking_id": canary, "manifest_b64": 5}, headers=api.h(api.t.submitter)
    )
    assert code_of(r) == "validation_error" and canary not in r.text


def test_unhandled_exception_is_an_envelope(tmp_path: Path) -> None:
    app = create_app(Settings(db_path=tmp_path / "x.db"))

    def boom() -> None:
        raise RuntimeError("kaboom with detail")

    app.add_api_route("/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    assert r.status_code == 500 and code_of(r) == "internal_error"
    assert "kaboom" not in r.text


def test_healthz(api: Api) -> None:
    body = api.client.get("/healthz").json()
    assert body["ok"] and body["data"]["status"] == "ok" and body["data"]["schema_version"] >= 1
    # The scrape is not on the API socket (it has its own listener: tests/api/test_isolation.py).
    assert api.client.get("/metrics").status_code == 404


def test_every_code_has_a_status_and_a_meaning() -> None:
    for code in ErrorCode:
        assert 400 <= code.http_status <= 599, code
        assert len(code.meaning) > 10 and "|" not in code.meaning, code
    rows = re.findall(
        r"^\| `([a-z0-9_]+)` \| (\d{3}) \| (.+) \|$", (DOCS / "errors.md").read_text(), re.M
    )
    assert {code: int(status) for code, status, _ in rows} == {
        c.value: c.http_status for c in ErrorCode
    }


def test_docs_errors_md_is_generated_from_the_enum() -> None:
    committed = (DOCS / "errors.md").read_text()
    assert committed == markdown_table(), (
        "docs/errors.md is stale: python -m stages.errors --markdown > docs/errors.md"
    )


def test_the_server_answers_each_code_with_its_status() -> None:
    assert status_of(ErrorCode.credential_revoked) == 401
    assert status_of(ErrorCode.path_outside_root) == 422
    assert status_of("no_such_code") == 500


def test_committed_openapi_equals_served(tmp_path: Path) -> None:
    app = create_app(Settings(db_path=tmp_path / "x.db", api_docs=True))
    with TestClient(app) as client:
        served = client.get("/openapi.json").json()
    committed = json.loads((DOCS / "openapi.json").read_text())
    assert served == committed, (
        "docs/openapi.json is stale: python -m orchestrator.api > docs/openapi.json"
    )


def test_chunked_body_over_cap_is_refused(tmp_path: Path) -> None:
    app = create_app(Settings(db_path=tmp_path / "x.db", max_body_bytes=1000))

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b"x" * 500

    with TestClient(app) as client:
        r = client.post("/v1/plans", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and code_of(r) == "payload_too_large"
