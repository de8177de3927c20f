"""A curriculum run through the canonical API on a real local Ray: two phases
(pretrain at 64 tokens, long_context at 128), real lm-eval batteries at each phase
end, and a second gate that cannot pass. The run must end ``failed`` /
``eval_gate_failed`` with the failing check (score, threshold, phase) in the status,
the stage gates, the events, the logs and the metrics; then every way around the
gate we can think of is refused with its code.

The runtime modules' one paced server (``paced_server`` of tests/runtime/conftest.py,
its embedded Ray head started once for this module, test_run_controls_on_ray.py and
test_runs_on_ray.py; the module's name puts it between them); a tiny model; only the
GPUs are absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import Backend
from helpers.flows import confirm, confirm_ref, submit
from helpers.manifests import cpu_testbed_manifest, data_ref
from helpers.runs import api_data, wait_final
from helpers.tenants import Tenant
from helpers.testbed_runs import serve_module
from helpers.xdist_groups import module_group

# Above pytest's 300 s default: a run may take RUN_TIMEOUT_S once the server is up.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), module_group(__name__)]
RUN_TIMEOUT_S = 300.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rt(paced_server: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    # The pace (0.15 s a step) adds ~2 s to the run's 12 steps; a server of its own
    # costs ~25 s to start and stop.
    yield from serve_module(paced_server, request)


def _manifest(rt: dict[str, Any], second_gate_max: float) -> dict[str, Any]:
    refs = [data_ref(rt["baseline"], "baseline"), data_ref(rt["custom"], "custom")]
    phases = [
        {
            "name": "pretrain",
            "kind": "pretrain",
            "token_fraction": 0.5,
            "eval_battery": "smoke",
            "gates": [{"metric": "heldout_loss", "max": 100.0}],
        },
        {
            "name": "long",
            "kind": "long_context",
            "token_fraction": 0.5,
            "seq_len": 128,
            "data_weights": {"custom": 3.0},
            "eval_battery": "smoke",
            "gates": [{"metric": "heldout_loss", "max": second_gate_max}],
        },
    ]
    return cpu_testbed_manifest(
        refs,
        rt["tmp"] / "ckpt",
        steps=12,
        name=f"cur-{uuid.uuid4().hex[:6]}",
        interval_steps=4,
        keep=1,
        curriculum={"phases": phases},
    )


def _get(rt: dict[str, Any], path: str) -> dict[str, Any]:
    return api_data(rt["backend"], rt["tenant"].submitter, path)


@pytest.fixture(scope="module")
def failed(rt: dict[str, Any]) -> dict[str, Any]:
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    m = _manifest(rt, second_gate_max=0.001)
    key = f"key-{uuid.uuid4().hex}"
    with be.client() as c:
        ref = confirm_ref(c, t.approver, "train", t.booking_id, manifest=m)
        r = submit(c, t.submitter, t.booking_id, m, ref, idempotency_key=key)
    assert r.json()["ok"], r.json()
    run_id = r.json()["data"]["run_id"]
    run = wait_final(be, t.submitter, run_id, RUN_TIMEOUT_S)
    return {"run": run, "run_id": run_id, "manifest": m, "key": key, "ref": ref}


def test_second_gate_fails_the_run_with_its_check_everywhere(
    rt: dict[str, Any], failed: dict[str, Any]
) -> None:
    run, run_id = failed["run"], failed["run_id"]
    assert run["state"] == "failed", run
    assert "eval_gate_failed" in json.dumps(run["stage_gates"])
    train = next(g for g in run["stage_gates"] if g["stage"] == "train")
    assert train["status"] == "failed" and train["error_code"] == "eval_gate_failed"
    assert "phase long" in run["state_reason"] and "heldout_loss" in run["state_reason"]
    gates = {g["phase"]: g for g in run["eval_gates"]}
    assert gates["pretrain"]["passed"] and not gates["long"]["passed"]
    bad = [c for c in gates["long"]["checks"] if not c["passed"]]
    assert [(c["check"], c["max"]) for c in bad] == [("heldout_loss", 0.001)]
    assert bad[0]["score"] > 0.001
    logs = _get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]
    assert any(e["level"] == "error" for e in logs)  # the verdict is in the gates above
    # Telemetry: every score, and evaluation time as badput.
    metrics = _get(rt, f"/v1/runs/{run_id}/metrics")
    scored = {(e["phase"], e["check"]) for e in metrics["eval_scores"]}
    assert ("pretrain", "arith_mc_acc") in scored and ("long", "heldout_loss") in scored
    assert metrics["badput_s"]["evaluation"] > 0
    text = httpx.get(rt["backend"].metrics_url, timeout=30).text
    assert (
        f'ito_run_eval_score{{booking_id="{rt["tenant"].booking_id}",check="heldout_loss",'
        f'phase="long",run_id="{run_id}"}}' in text
    )
    # The checkpoint that closed pretrain is listed with its phase despite keep=1.
    ckpts = _get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    closing = {c["step"]: c["phase"] for c in ckpts if c["closes_phase"]}
    assert closing == {6: "pretrain", 12: "long"}


def test_no_override_path_exists(rt: dict[str, Any], failed: dict[str, Any]) -> None:
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    run_id = failed["run_id"]
    with be.client() as c:
        auth = {"Authorization": f"Bearer {t.submitter}"}
        # 1. approve/decline do not apply to gates: there is no proposal to approve.
        for gate_name in ("long", "eval_gate", "train"):
            r = c.post(
                f"/v1/runs/{run_id}/proposals/{gate_name}/approve",
                json={"confirmation_ref": "cref_x"},
                headers={**auth, "Idempotency-Key": f"ap-{uuid.uuid4().hex}"},
            )
            assert r.json()["error"]["code"] == "proposal_not_found"
        # 2. A new manifest (the gate loosened) under the same idempotency key.
        loose = _manifest(rt, second_gate_max=1000.0)
        ref = confirm_ref(c, t.approver, "train", t.booking_id, manifest=loose)
        r = submit(c, t.submitter, t.booking_id, loose, ref, idempotency_key=failed["key"])
        assert r.json()["error"]["code"] == "idempotency_conflict"
        # 3. Resubmitting (after a cancel, or not) with the consumed confirmation.
        cref = confirm_ref(c, t.approver, "cancel", t.booking_id, run_id=run_id, cost_usd=0.0)
        r = c.post(
            f"/v1/runs/{run_id}/cancel",
            json={"confirmation_ref": cref},
            headers={**auth, "Idempotency-Key": f"cancel-{uuid.uuid4().hex}"},
        )
        assert r.json()["error"]["code"] == "invalid_state"  # failed is final
        r = submit(c, t.submitter, t.booking_id, failed["manifest"], failed["ref"])
        assert r.json()["error"]["code"] == "confirmation_consumed"
        # 4. No API route overrides a gate or a state.
        for path in (
            f"/v1/runs/{run_id}/gates/long/override",
            f"/v1/runs/{run_id}/override",
            f"/v1/runs/{run_id}/resume",
            f"/v1/runs/{run_id}/retry",
        ):
            r = c.post(path, json={}, headers=auth)
            assert r.status_code in (404, 405) and not r.json()["ok"]
        # 5. The manifest has no override field: an unknown key is refused.
        m = _manifest(rt, second_gate_max=0.001)
        m["curriculum"]["phases"][1]["override"] = True
        env = confirm(c, t.approver, "train", t.booking_id, manifest=m)
        assert env["error"]["code"] == "manifest_invalid"  # not even confirmable
        r = submit(c, t.submitter, t.booking_id, m, failed["ref"])
        assert r.json()["error"]["code"] == "manifest_invalid"
    # 6. The operator CLI has no override either: no such command.
    for args in (["runs", "override", run_id], ["gates", "override", run_id]):
        p = subprocess.run(
            [sys.executable, "-m", "orchestrator.admin", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2 and "No such command" in p.stderr
    assert _get(rt, f"/v1/runs/{run_id}")["state"] == "failed"
