"""Runs through the canonical API on a real local Ray, what surrounds training: no
secret reaches a driver or worker log, a loss-spike proposal waits for its decision,
Prometheus scrapes goodput, and a run's authority ends with its booking, account or
term while the host's files stay private. Lifecycle and recovery are
test_runs_on_ray.py.

One backend (``ito-backend serve --runtime ray``, its own embedded Ray head on free
ports) serves this module and test_runs_on_ray.py (the ``paced_server`` of
tests/runtime/conftest.py: one server start-up, not two); runs use a tiny model on
the ``cpu-testbed`` booking. Only the GPUs are absent: every process, kill and restart here is real.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import Backend, free_port
from helpers.flows import confirm_ref, submit
from helpers.tenants import Tenant, admin, cpu_booking_doc, make_tenant
from helpers.testbed_runs import (
    api_get,
    last_step,
    run_actors,
    run_manifest,
    serve_module,
    submit_testbed,
    wait_for_run,
)
from helpers.tools import require
from helpers.waiting import wait_until
from helpers.xdist_groups import module_group

from orchestrator.db.store import Store
from orchestrator.gates.bookings import BookingFile, add_booking, parse_iso
from orchestrator.runtime import ray_cluster

# Above pytest's 300 s default: a run may take RUN_TIMEOUT_S once the server is up.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), module_group(__name__)]
# How long the test's approver takes to approve: the window in which nothing may move
# (an observation window, not a wait for anything to happen).
DECISION_DELAY_S = 3.0


@pytest.fixture(scope="module")
def rt(paced_server: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    # The canary is in the server's environment from its start: every run on it has it
    # to leak, and the canary test needs no server restart of its own.
    yield from serve_module(paced_server, request)


def test_canary_secret_reaches_no_driver_or_worker_log(rt: dict[str, Any]) -> None:
    """The canary of tests/api/test_canary.py, once with the Ray runtime: planted in the
    API server's environment and sent as an idempotency key, it appears in no file of
    the backend's var dir (store, scratch, checkpoints), no Ray session log (driver,
    trainer and worker logs) and not in the server's log, after a run succeeded."""
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    canary: str = rt["canary"]
    m = run_manifest(rt, steps=10, name=f"run-{uuid.uuid4().hex[:6]}")
    with be.client() as c:
        ref = confirm_ref(c, t.approver, "train", t.booking_id, manifest=m)
        r = submit(c, t.submitter, t.booking_id, m, ref, canary)
        assert r.json()["error"]["code"] == "idempotency_key_invalid"
        assert canary not in r.text
    run_id = submit_testbed(rt, steps=10)
    wait_for_run(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    head_pid = (be.var_dir / "ray-head.pid").read_text().strip()
    sessions = list(ray_cluster.ray_temp_dir(be.var_dir).glob(f"session_*_{head_pid}"))
    assert sessions, "the embedded head's Ray session folder was not found"
    files = [
        p
        for root in (be.var_dir, *sessions)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and p.stat().st_size < 64 << 20
    ]
    assert any("worker" in p.name for p in files), "no Ray worker log was searched"
    assert [p for p in files if canary.encode() in p.read_bytes()] == []
    assert canary not in be.log_text()


def test_loss_spike_proposal_waits_for_approval_through_the_api(rt: dict[str, Any]) -> None:
    """A poisoned data batch (operator test knob) spikes the loss: the run shows the
    proposal and awaits approval; nothing moves until an approver's confirmed approve."""
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    be.stop()
    old_env = dict(be.env)
    be.env["ITO_TRAIN_OVERRIDES"] = json.dumps(
        {"pace_step_s": 0.05, "inject_loss_spike": {"batches": [24], "scale": 50.0}}
    )
    be.proc = None
    be.start()
    try:
        run_id = submit_testbed(
            rt,
            steps=36,
            loss_spike={"window": 10, "z_threshold": 6.0, "min_steps": 10, "skip_window_steps": 4},
        )
        run = wait_for_run(
            rt, run_id, lambda r: r["state"] == "awaiting_approval", "awaiting_approval"
        )
        (proposal,) = run["proposals"]
        assert proposal["status"] == "pending"
        assert proposal["params"]["from_step"] == 20
        assert "restart" in proposal["description"]
        time.sleep(DECISION_DELAY_S)  # the approver takes a while: nothing may move
        assert api_get(rt, f"/v1/runs/{run_id}")["state"] == "awaiting_approval"
        approved_at = time.time()
        with be.client() as c:
            ref = confirm_ref(
                c,
                t.approver,
                "restart",
                t.booking_id,
                run_id=run_id,
                proposal_id=proposal["proposal_id"],
                cost_usd=0.0,
            )
            r = c.post(
                f"/v1/runs/{run_id}/proposals/{proposal['proposal_id']}/approve",
                json={"confirmation_ref": ref},
                headers={
                    "Authorization": f"Bearer {t.submitter}",
                    "Idempotency-Key": f"approve-{run_id}",
                },
            )
        assert r.json()["ok"], r.json()
        run = wait_for_run(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
        assert run["proposals"][0]["status"] == "approved"
        # Nothing moved on its own between the proposal and the approval: no step past
        # the spike's (25), no restore.
        store = Store(be.db)
        (proposed,) = store.list_events(run_id, kinds=["proposal"])
        held = [
            e["payload"]
            for e in store.list_events(run_id, kinds=["step", "fleet"])
            if proposed["payload"]["ts"] < e["payload"]["ts"] < approved_at
        ]
        assert not [e for e in held if e["kind"] == "step" and e["step"] > 25], held
        assert not [e for e in held if e.get("action") == "checkpoint_restored"], held
        # Approved: training went back to the proposal's checkpoint and on from there.
        after = [
            e["payload"]["step"]
            for e in Store(be.db).list_events(run_id, kinds=["step"])
            if e["payload"]["ts"] > approved_at
        ]
        assert after and min(after) == 21 and max(after) == 36, sorted(after)
    finally:
        be.stop()
        be.env = old_env
        be.proc = None
        be.start()


def test_prometheus_scrapes_goodput(rt: dict[str, Any], tmp_path: Path) -> None:
    prometheus = require("prometheus", "prometheus")["prometheus"]
    be: Backend = rt["backend"]
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: ito
    metrics_path: /metrics
    static_configs:
      - targets: ["127.0.0.1:{be.metrics_port}"]
""")
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        values: list[float] = []
        while time.monotonic() < deadline and not values:
            time.sleep(1)
            try:
                r = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/query",
                    params={"query": "ito_run_goodput_ratio"},
                    timeout=5,
                ).json()
            except httpx.HTTPError:
                continue
            values = [float(s["value"][1]) for s in r.get("data", {}).get("result", [])]
        assert values, "prometheus never returned the goodput series"
        assert max(values) > 0
    finally:
        prom.terminate()
        prom.wait(timeout=10)


# --- authority ends when it ends; the host stays private ----------------------------------
def _wait_store(
    rt: dict[str, Any], run_id: str, state: str, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Wait on the store itself (a disabled account's keys no longer read the API)."""
    store = Store(rt["backend"].db)

    def reached() -> dict[str, Any] | None:
        run = store.get_run(run_id)
        return run if run["state"] == state else None

    try:
        return wait_until(reached, timeout_s, f"run {run_id} {state}")
    except AssertionError as e:
        run = store.get_run(run_id)
        raise AssertionError(
            (run["state"], run["state_reason"], rt["backend"].log_text()[-3000:])
        ) from e


def _assert_torn_down(rt: dict[str, Any], run_id: str) -> None:
    # The driver and every actor of its fleet are gone.
    wait_until(lambda: not run_actors(rt, run_id), 120.0, "the run's actors gone")


def test_a_running_run_stops_once_its_booking_is_revoked(rt: dict[str, Any]) -> None:
    be: Backend = rt["backend"]
    t = make_tenant(be.db, "revokee", booking=cpu_booking_doc("bk-revokee", "revokee"))
    run_id = submit_testbed(rt, steps=2000, tenant=t)
    wait_for_run(
        rt,
        run_id,
        lambda r: r["state"] == "running" and last_step(rt, run_id, t) >= 3,
        "a few steps",
        tenant=t,
    )
    assert any("trainer" in a.name for a in run_actors(rt, run_id))
    admin(be.db, "bookings", "revoke", t.booking_id)  # the upstream revocation (mocked)
    revoked_at = Store(be.db).booking(t.booking_id)["updated_at"]  # type: ignore[index]
    run = wait_for_run(rt, run_id, lambda r: r["state"] == "cancelled", "cancelled", tenant=t)
    assert run["state_reason"].startswith("booking_revoked: "), run["state_reason"]
    # The stop followed the revocation (how soon is the supervisor's authority-check
    # interval, a setting, not something a test on a shared machine can assert).
    stopped_s = parse_iso(run["updated_at"]) - revoked_at
    print(f"booking revoked -> run cancelled in {stopped_s:.1f} s (run timestamps)")
    assert stopped_s > 0
    _assert_torn_down(rt, run_id)


def test_a_disabled_account_and_an_ended_term_stop_queued_and_running_runs(
    rt: dict[str, Any],
) -> None:
    """One run trains; two more wait for the head it holds (queued in ``starting``).
    The term of one queued run's booking ends (the upstream registry shortens it,
    mocked by writing the store): that run is cancelled with booking_term_ended.
    Then the operator disables the account: the running and the other queued run
    are cancelled with account_disabled and nothing of them stays on Ray."""
    be: Backend = rt["backend"]
    t = make_tenant(be.db, "lapsing", booking=cpu_booking_doc("bk-lapse-1", "lapsing"))
    store = Store(be.db)
    add_booking(store, BookingFile.model_validate(cpu_booking_doc("bk-lapse-2", "lapsing")))
    running = submit_testbed(rt, steps=2000, tenant=t)
    wait_for_run(
        rt,
        running,
        lambda r: r["state"] == "running" and last_step(rt, running, t) >= 2,
        "a few steps",
        tenant=t,
    )
    term_ends = submit_testbed(rt, steps=20, tenant=t, booking_id="bk-lapse-2")
    disabled = submit_testbed(rt, steps=20, tenant=t)
    for run_id in (term_ends, disabled):
        wait_for_run(
            rt,
            run_id,
            lambda r: r["state"] == "starting" and "waiting for booking" in r["state_reason"],
            "queued behind the running run",
            timeout_s=60,
            tenant=t,
        )
    with store.tx() as c:
        c.execute(
            "UPDATE bookings SET term_end = ? WHERE booking_id = 'bk-lapse-2'", (time.time(),)
        )
    run = _wait_store(rt, term_ends, "cancelled")
    assert run["state_reason"].startswith("booking_term_ended: "), run["state_reason"]
    assert store.get_run(running)["state"] == "running"

    admin(be.db, "accounts", "disable", "lapsing")
    for run_id in (disabled, running):
        run = _wait_store(rt, run_id, "cancelled")
        assert run["state_reason"].startswith("account_disabled: "), run["state_reason"]
        _assert_torn_down(rt, run_id)


def _private(path: Path) -> bool:
    return path.lstat().st_uid == os.geteuid() and not path.lstat().st_mode & 0o077


def test_host_files_stay_private_while_a_run_executes_and_runs_stop_is_audited(
    rt: dict[str, Any],
) -> None:
    be: Backend = rt["backend"]
    run_id = submit_testbed(rt, steps=2000)
    wait_for_run(
        rt, run_id, lambda r: r["state"] == "running" and last_step(rt, run_id) >= 4, "a few steps"
    )
    # While it trains: Ray's temp root, its token and the run's scratch (which holds
    # the cleaned tenant data) are the backend user's alone.
    root = ray_cluster.ray_private_root(be.var_dir)
    assert stat.S_IMODE(root.lstat().st_mode) == 0o700 and _private(root)
    token = ray_cluster.auth_token_path()
    assert stat.S_IMODE(token.lstat().st_mode) == 0o600
    assert _private(be.var_dir) and _private(be.var_dir / "runs")
    scratch = be.var_dir / "runs" / run_id
    entries = [scratch, *scratch.rglob("*")]
    files = [p for p in entries if p.is_file() and not p.is_symlink()]
    assert files, "the run wrote no scratch"
    assert [str(p) for p in entries if not _private(p)] == []

    admin(be.db, "runs", "stop", run_id, "--reason", "operator test: abuse report")
    run = wait_for_run(rt, run_id, lambda r: r["state"] == "cancelled", "cancelled")
    assert run["state_reason"].startswith("operator_stopped: operator test: abuse report")
    _assert_torn_down(rt, run_id)
    rows = Store(be.db).read(
        "SELECT * FROM audit_events WHERE action = 'admin:runs.stop' AND run_id = ?", (run_id,)
    )
    assert len(rows) == 1 and rows[0]["code"] == "operator_stopped"
