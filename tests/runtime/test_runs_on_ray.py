"""Runs through the canonical API on a real local Ray: the supervisor, the per-run
driver, the stages, cancel, a replica-group kill, an API-server SIGKILL, a lost
driver and the server's graceful SIGTERM. Secrets, proposals, telemetry and authority
are test_run_controls_on_ray.py (a module of its own: under pytest-xdist the two may
run on two test workers, each with a server of its own).

One backend (``ito-backend serve --runtime ray``, which starts its own embedded Ray
head on free ports) serves this module and test_run_controls_on_ray.py (the
``paced_server`` of tests/runtime/conftest.py); runs use a tiny model on the
``cpu-testbed`` booking. Only the GPUs are absent: every process, kill and
restart here is real.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import Backend
from helpers.flows import confirm_ref
from helpers.manifests import TESTBED_CHECKPOINT_STEPS
from helpers.tenants import Tenant
from helpers.testbed_runs import (
    ACTORS_GONE_TIMEOUT_S,
    RUN_TIMEOUT_S,
    api_get,
    last_step,
    run_actors,
    serve_module,
    submit_testbed,
    wait_for_run,
)
from helpers.waiting import wait_until
from helpers.xdist_groups import module_group

from orchestrator.db.store import Store
from stages.checkpointing.storage import list_checkpoints

# Above pytest's 300 s default: a run may take RUN_TIMEOUT_S once the server is up.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), module_group(__name__)]


@pytest.fixture(scope="module")
def rt(paced_server: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    yield from serve_module(paced_server, request)


def test_submitted_run_succeeds_with_gates_checkpoints_and_goodput(rt: dict[str, Any]) -> None:
    run_id = submit_testbed(rt, steps=12)
    run = wait_for_run(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    gates = {g["stage"]: g["status"] for g in run["stage_gates"]}
    assert gates == {"data_prep": "passed", "parallelism": "passed", "train": "passed"}
    # The train gate shows the layout its workers built, read back from their mesh:
    # the plan's.
    train = next(g for g in run["stage_gates"] if g["stage"] == "train")
    built = {dim: train["metrics"][f"layout_{dim}"] for dim in ("pp", "dp_shard", "cp", "tp")}
    assert built == {dim: float(run["plan"][dim]) for dim in built}
    ckpts = api_get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    assert ckpts and max(c["step"] for c in ckpts) == 12
    assert all(Path(c["path"]).is_dir() for c in ckpts)
    metrics = api_get(rt, f"/v1/runs/{run_id}/metrics")
    assert metrics["goodput"] > 0
    assert metrics["tokens_per_s"] > 0
    # Nothing of a finished run stays alive (Ray reaps its actors shortly after).
    wait_until(
        lambda: not run_actors(rt, run_id),
        ACTORS_GONE_TIMEOUT_S,
        "every actor of the finished run gone",
    )


def test_ray_dashboard_keeps_token_auth(rt: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{rt['dashboard']}/api/v0/actors"
    assert httpx.get(url, timeout=10).status_code == 401
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    ok = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert ok.status_code == 200


def test_cancel_mid_run_stops_every_actor_keeps_checkpoints_then_cleanup(
    rt: dict[str, Any],
) -> None:
    run_id = submit_testbed(rt, steps=2000)
    wait_for_run(
        rt, run_id, lambda r: r["state"] == "running" and last_step(rt, run_id) >= 6, "a few steps"
    )
    assert any("trainer" in a.name for a in run_actors(rt, run_id))
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    with be.client() as c:
        ref = confirm_ref(c, t.approver, "cancel", t.booking_id, run_id=run_id, cost_usd=0.0)
        r = c.post(
            f"/v1/runs/{run_id}/cancel",
            json={"confirmation_ref": ref},
            headers={
                "Authorization": f"Bearer {t.submitter}",
                "Idempotency-Key": f"cancel-{run_id}",
            },
        )
    assert r.json()["ok"], r.json()
    assert r.json()["data"]["state"] in ("cancelling", "cancelled")
    wait_for_run(rt, run_id, lambda r: r["state"] == "cancelled", "cancelled")
    wait_until(
        lambda: not run_actors(rt, run_id),
        ACTORS_GONE_TIMEOUT_S,
        "every actor of the cancelled run gone",
    )
    ckpts = api_get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    assert ckpts and all(Path(c["path"]).is_dir() for c in ckpts)
    # The ranks stopped and reported before they were killed: every checkpoint on
    # disk is on the run's record, the one committed since the last poll included.
    on_disk = {r.step for r in list_checkpoints(rt["tmp"] / "ckpt" / run_id)}
    assert {c["step"] for c in ckpts} == on_disk

    # Cleanup (its own confirmation) removes scratch and checkpoints, never the booking.
    with be.client() as c:
        ref = confirm_ref(c, t.approver, "cleanup", t.booking_id, run_id=run_id, cost_usd=0.0)
        r = c.post(
            f"/v1/runs/{run_id}/cleanup",
            json={"confirmation_ref": ref},
            headers={
                "Authorization": f"Bearer {t.submitter}",
                "Idempotency-Key": f"cleanup-{run_id}",
            },
        )
    body = r.json()
    assert body["ok"], body
    ckpt_dir = rt["tmp"] / "ckpt" / run_id
    assert str(ckpt_dir) in body["data"]["removed"] and body["data"]["bytes_removed"] > 0
    assert not ckpt_dir.exists() and not (be.var_dir / "runs" / run_id).exists()
    assert api_get(rt, f"/v1/runs/{run_id}")["state"] == "cleaned"
    assert api_get(rt, f"/v1/bookings/{t.booking_id}/eligibility")["eligible"] is True


def test_replica_group_kill_is_an_interruption_and_the_run_still_succeeds(
    rt: dict[str, Any],
) -> None:
    # Long enough that the killed rank is back (a warm standby) before training ends.
    run_id = submit_testbed(rt, steps=120)
    wait_for_run(
        rt, run_id, lambda r: r["state"] == "running" and last_step(rt, run_id) >= 3, "a few steps"
    )
    # The standby warms up once the fleet trains: the kill must find it warm.
    store = Store(rt["backend"].db)
    wait_until(
        lambda: any(
            e["payload"]["action"] == "standby_warm"
            for e in store.list_events(run_id, kinds=["fleet"])
        ),
        RUN_TIMEOUT_S,
        "a warm standby",
    )
    # The dashboard's actor list can trail the run's events on a loaded machine.
    victims = wait_until(
        lambda: [a for a in run_actors(rt, run_id) if a.name.endswith("-trainer-rg1-rank0")],
        RUN_TIMEOUT_S,
        "group 1's rank in the dashboard's actor list",
    )
    os.kill(int(victims[0].pid), signal.SIGKILL)  # a real process kill
    wait_for_run(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    metrics = api_get(rt, f"/v1/runs/{run_id}/metrics")
    assert metrics["interruptions"] >= 1
    # The run reports its own recovery: seconds from the death (Ray's record of the
    # process's end) to its detection, and to the full quorum again.
    lost = [t for t in metrics["interruption_timings"] if t["kind"] == "replica_group_lost"]
    assert lost and lost[0]["replica_group"] == 1
    assert lost[0]["detect_s"] is not None and lost[0]["recover_s"] is not None
    assert 0 <= lost[0]["detect_s"] <= lost[0]["recover_s"]
    assert metrics["detect_s"] and metrics["recover_s"]
    text = httpx.get(rt["backend"].metrics_url, timeout=10).text
    line = next(
        li
        for li in text.splitlines()
        if li.startswith("ito_run_interruptions_total{") and run_id in li
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1
    for family in ("detect", "recover"):
        assert any(
            li.startswith(f"ito_run_interruption_{family}_seconds{{")
            and run_id in li
            and 'kind="replica_group_lost"' in li
            for li in text.splitlines()
        ), family


def test_api_server_sigkill_mid_run_reattaches_and_loses_no_event(rt: dict[str, Any]) -> None:
    be: Backend = rt["backend"]
    run_id = submit_testbed(rt, steps=60)
    wait_for_run(
        rt, run_id, lambda r: r["state"] == "running" and last_step(rt, run_id) >= 5, "a few steps"
    )
    before = api_get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]
    assert before
    be.kill()  # SIGKILL: no shutdown hook runs
    be.proc = None
    be.start()  # same DB, same var dir: the embedded Ray head and the driver live on
    run = wait_for_run(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    after = api_get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]
    after_keys = {(e["seq"], e["message"]) for e in after}
    assert all((e["seq"], e["message"]) in after_keys for e in before)
    # Reattached, not relaunched: the driver survived the API server.
    lost = Store(be.db).list_events(run_id, kinds=["interruption"])
    assert not [e for e in lost if e["payload"]["interruption_kind"] == "driver_lost"]
    assert run["state"] == "succeeded"


def test_lost_driver_is_relaunched_and_training_resumes_from_its_checkpoint(
    rt: dict[str, Any],
) -> None:
    run_id = submit_testbed(rt, steps=40)
    wait_for_run(
        rt,
        run_id,
        lambda r: r["state"] == "running" and last_step(rt, run_id) >= 12,
        "a checkpoint",
    )
    assert api_get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    (driver,) = [a for a in run_actors(rt, run_id) if a.name == f"run-{run_id}"]
    os.kill(int(driver.pid), signal.SIGKILL)  # the driver process dies (its trainers with it)
    run = wait_for_run(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    store = Store(rt["backend"].db)
    (lost,) = [
        e["payload"]
        for e in store.list_events(run_id, kinds=["interruption"])
        if e["payload"]["interruption_kind"] == "driver_lost"
    ]
    assert lost["recovered_at"] is not None  # relaunched once, not failed
    # The second driver skipped the passed stages (a stage's result is written once)...
    results = [e["payload"]["stage"] for e in store.list_events(run_id, kinds=["stage_result"])]
    assert results.count("data_prep") == 1 and results.count("parallelism") == 1, results
    # ...and trained on from a checkpoint: its first step follows one, not step 1. (The
    # lost driver may not have forwarded its newest one's event.)
    after = [
        e["payload"]["step"]
        for e in store.list_events(run_id, kinds=["step"])
        if e["payload"]["ts"] > lost["detected_at"]
    ]
    assert after, "no step after the driver was lost"
    first = min(after)
    assert first > 1 and (first - 1) % TESTBED_CHECKPOINT_STEPS == 0, sorted(after)[:5]
    metrics = api_get(rt, f"/v1/runs/{run_id}/metrics")
    assert metrics["interruptions"] >= 1 and metrics["last_step"] == 40
    assert {g["stage"]: g["status"] for g in run["stage_gates"]}["train"] == "passed"


def test_a_driver_lost_on_every_allowed_launch_fails_the_run_with_driver_lost(
    rt: dict[str, Any],
) -> None:
    """The relaunch limit: a run gets max_driver_attempts (2) launches; when the second
    driver dies too, the run fails with driver_lost instead of relaunching again."""
    run_id = submit_testbed(rt, steps=400)
    pids: list[int] = []
    for attempt in (1, 2):
        wait_for_run(
            rt,
            run_id,
            lambda r: (
                r["state"] == "running"
                and any(
                    a.name == f"run-{run_id}" and int(a.pid) not in pids
                    for a in run_actors(rt, run_id)
                )
            ),
            f"driver of launch {attempt}",
        )
        (driver,) = [a for a in run_actors(rt, run_id) if a.name == f"run-{run_id}"]
        pids.append(int(driver.pid))
        os.kill(int(driver.pid), signal.SIGKILL)
    run = wait_for_run(rt, run_id, lambda r: r["state"] == "failed", "failed")
    assert run["state_reason"].startswith("driver_lost"), run["state_reason"]
    lost = [
        e["payload"]
        for e in Store(rt["backend"].db).list_events(run_id, kinds=["interruption"])
        if e["payload"]["interruption_kind"] == "driver_lost"
    ]
    # The first loss was relaunched (recovered); the second ended the run.
    assert [e["recovered_at"] is not None for e in lost] == [True, False], lost
    wait_until(
        lambda: not run_actors(rt, run_id),
        ACTORS_GONE_TIMEOUT_S,
        "nothing of the failed run left running",
    )


def test_sigterm_shuts_the_ray_backed_server_down_gracefully(rt: dict[str, Any]) -> None:
    """``ray.init`` in the server replaces SIGTERM's handler with a bare ``sys.exit``;
    the server's own must stay: uvicorn's graceful shutdown, then its re-raised SIGTERM.
    Last in the module: the server stays down (the fixture's stop is then a no-op)."""
    be: Backend = rt["backend"]
    assert be.proc is not None
    sent_at = time.time()
    be.proc.send_signal(signal.SIGTERM)
    assert be.proc.wait(timeout=40) == -signal.SIGTERM
    log = be.log_text()
    assert "Application shutdown complete" in log
    assert "sigterm_handler" not in log, log[-3000:]
    # The shutdown released the supervisor lease: a standby need not wait it out.
    lease = Store(be.db).lease("supervisor")
    assert lease is not None and lease["expires_at"] <= time.time() + 1.0
    assert lease["expires_at"] >= sent_at - 1.0
