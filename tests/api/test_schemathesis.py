"""schemathesis against the served OpenAPI of a real server process: no 5xx, and every
body is an envelope. Bounded (a fixed number of generated requests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from helpers.backend import start_backend
from helpers.tenants import SCOPES, make_tenant
from hypothesis import HealthCheck, given, settings

from stages.errors import ErrorCode

MAX_EXAMPLES = 100  # across all operations; keeps the test bounded (~20 s idle)


@pytest.mark.slow
def test_fuzz_served_openapi(tmp_path: Path) -> None:
    backend = start_backend(tmp_path / "b", extra_args=["--api-docs"])  # docs are opt-in
    try:
        t = make_tenant(backend.db, "acme", roles={"all": tuple(SCOPES)})
        schema = schemathesis.openapi.from_url(backend.url + "/openapi.json")
        seen: list[int] = []

        @given(case=schema.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case) -> None:
            headers = dict(case.headers or {})
            headers.setdefault("Authorization", f"Bearer {t.keys['all']}")
            resp = case.call(base_url=backend.url, headers=headers, timeout=30)
            seen.append(resp.status_code)
            assert resp.status_code < 500, (case.method, case.path, resp.text)
            body = resp.json()
            assert isinstance(body, dict) and body.get("live_api_contacted") is True
            if body["ok"]:
                assert set(body) == {"ok", "live_api_contacted", "notice", "data"}
            else:
                assert set(body) == {"ok", "live_api_contacted", "notice", "error"}
                assert body["error"]["code"] in set(ErrorCode)

        fuzz()
        assert len(seen) >= MAX_EXAMPLES // 2
    finally:
        backend.stop()
    assert "Traceback" not in backend.log_text()
