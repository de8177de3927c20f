"""schemathesis against the served OpenAPI of a real server process: no 5xx, and every
body is an envelope. Every call carries a valid key (with every scope) so the generated
inputs reach the handlers, not just the auth check, and the server runs with the planner
gate on, as in production. Bounded: a fixed number of generated requests per operation."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import schemathesis
from helpers.backend import start_backend
from helpers.tenants import SCOPES, make_tenant
from hypothesis import HealthCheck, given, settings

from stages.errors import ErrorCode

EXAMPLES_PER_OPERATION = 20  # 15 operations -> 300 generated requests


@pytest.mark.slow
def test_fuzz_served_openapi(tmp_path: Path) -> None:
    # production runs the planner gate; the docs are opt-in
    backend = start_backend(tmp_path / "b", extra_args=["--planner-gate", "--api-docs"])
    try:
        t = make_tenant(backend.db, "acme", roles={"all": tuple(SCOPES)})
        schema = schemathesis.openapi.from_url(backend.url + "/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]
        statuses: Counter[int] = Counter()
        by_operation: dict[str, Counter[int]] = {}

        for op in operations:

            @given(case=op.as_strategy())
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case: schemathesis.Case) -> None:
                # schemathesis generates its own (random) Authorization for the bearer
                # scheme; replace it so the case is judged by the handler.
                headers = {
                    k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"
                }
                headers["Authorization"] = f"Bearer {t.keys['all']}"
                case.headers = headers
                resp = case.call(base_url=backend.url, timeout=30)
                by_operation.setdefault(case.operation.label, Counter())[resp.status_code] += 1
                statuses[resp.status_code] += 1
                assert resp.status_code < 500, (case.method, case.path, resp.text)
                body = resp.json()
                assert isinstance(body, dict) and body.get("live_api_contacted") is True
                if body["ok"]:
                    assert set(body) == {"ok", "live_api_contacted", "notice", "data"}
                else:
                    assert set(body) == {"ok", "live_api_contacted", "notice", "error"}
                    assert body["error"]["code"] in set(ErrorCode)
                    assert body["error"]["code"] not in ("unauthenticated", "forbidden_scope"), body

            fuzz()

        by_class = Counter(f"{code // 100}xx" for code in statuses.elements())
        print(
            f"schemathesis: {sum(statuses.values())} cases, by class {dict(by_class)}, "
            f"by status {dict(sorted(statuses.items()))}"
        )
        # Every operation was exercised, and answered by its handler (never an auth error).
        assert set(by_operation) == {op.label for op in operations}
        assert all(sum(c.values()) >= 1 for c in by_operation.values()), by_operation
        # The inputs reached several outcomes: successes and several kinds of refusal.
        assert by_class["2xx"] > 0 and by_class["4xx"] > 0, statuses
        assert len({c for c in statuses if 400 <= c < 500}) >= 3, statuses
    finally:
        backend.stop()
    assert "Traceback" not in backend.log_text()
