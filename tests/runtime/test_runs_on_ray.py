"""Runs through the canonical API on a real local Ray: the supervisor, the per-run
driver, the stages, cancel, a replica-group kill, an API-server SIGKILL, and the
Prometheus export.

One backend (``ito-backend serve --runtime ray``, which starts its own embedded Ray
head on free ports) serves the whole module; runs use a tiny model on the
``cpu-testbed`` booking. Only the GPUs are absent: every process, kill and
restart here is real.
"""

from __future__ import annotations

import json
import os
import signal
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
from helpers.ray_backend import corpora, ray_backend
from helpers.tenants import Tenant, admin, cpu_booking_doc, make_tenant
from helpers.tools import require
from helpers.waiting import wait_until
from helpers.xdist_groups import embedded_ray_head_group

from orchestrator.db.store import Store
from orchestrator.gates.bookings import BookingFile, add_booking, parse_iso
from orchestrator.runtime import ray_cluster

# Above pytest's 300 s default: a run may take RUN_TIMEOUT_S once the server is up.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), embedded_ray_head_group]

RUN_TIMEOUT_S = 300.0
# A run's actors are reaped by Ray after its state is final: a hang guard, not a bound.
ACTORS_GONE_TIMEOUT_S = 120.0
REPO = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    from stages.data_prep import file_sha256

    return str(file_sha256(path))


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ray-runtime")
    baseline, custom = corpora(tmp / "data", 400, 300)
    # Operator knob: pace steps so a tiny model's run lasts long enough to cancel it,
    # kill a group in it, or kill the API server under it.
    with ray_backend(
        tmp, "bk-cpu", env={"ITO_TRAIN_OVERRIDES": json.dumps({"pace_step_s": 0.15})}
    ) as rt:
        yield {**rt, "baseline": baseline, "custom": custom}


def _manifest(rt: dict[str, Any], *, steps: int, name: str, **sections: Any) -> dict[str, Any]:
    def ref(p: Path, role: str) -> dict[str, Any]:
        return {
            "uri": f"file://{p}",
            "sha256": _sha(p),
            "role": role,
            "format": "jsonl",
            "text_field": "text",
            "provenance": {"source": "test", "license": "MIT"},
        }

    return {
        "manifest_version": 1,
        "name": name,
        "model": {"preset": "llama-tiny", "size": "124K"},
        "data": {
            "refs": [ref(rt["baseline"], "baseline"), ref(rt["custom"], "custom")],
            "eval_suites": ["gsm8k"],
            "ladder_probe": {"enabled": False},
        },
        "training": {
            "max_steps": steps,
            "seq_len": 64,
            "global_batch_tokens": 512,
            "learning_rate": 0.003,
            "warmup_steps": 2,
        },
        "curriculum": {"phases": [{"name": "pretrain", "kind": "pretrain", "token_fraction": 1.0}]},
        "budget": {"ceiling_usd": 50.0, "max_incremental_cost_usd": 50.0},
        "checkpoint": {
            "interval_steps": 5,
            "keep": 2,
            "storage_uri": f"file://{rt['tmp'] / 'ckpt'}",
        },
        **sections,
    }


def _submit(
    rt: dict[str, Any],
    *,
    steps: int,
    tenant: Tenant | None = None,
    booking_id: str | None = None,
    **sections: Any,
) -> str:
    be: Backend = rt["backend"]
    t: Tenant = tenant or rt["tenant"]
    booking = booking_id or t.booking_id
    m = _manifest(rt, steps=steps, name=f"run-{uuid.uuid4().hex[:6]}", **sections)
    with be.client() as c:
        ref = confirm_ref(c, t.approver, "train", booking, manifest=m)
        r = submit(c, t.submitter, booking, m, ref)
    body = r.json()
    assert body["ok"], body
    run_id: str = body["data"]["run_id"]
    return run_id


def _get(rt: dict[str, Any], path: str, tenant: Tenant | None = None) -> dict[str, Any]:
    be: Backend = rt["backend"]
    with be.client((tenant or rt["tenant"]).submitter) as c:
        body: dict[str, Any] = c.get(path).json()
    assert body["ok"], body
    data: dict[str, Any] = body["data"]
    return data


def _wait(
    rt: dict[str, Any],
    run_id: str,
    pred: Any,
    what: str,
    timeout_s: float = RUN_TIMEOUT_S,
    tenant: Tenant | None = None,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            run = _get(rt, f"/v1/runs/{run_id}", tenant)
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if pred(run):
            return run
        if run["state"] in ("failed", "cancelled", "succeeded", "cleaned") and not pred(run):
            break
        time.sleep(0.5)
    logs = Store(rt["backend"].db).list_logs(run_id, 0, 1000)
    tail = "\n".join(f"{e['stage']}: {e['message']}" for e in logs[-40:])
    raise AssertionError(
        f"run {run_id} never reached {what}; last {run}\n{tail}\n{rt['backend'].log_text()[-3000:]}"
    )


def _last_step(rt: dict[str, Any], run_id: str, tenant: Tenant | None = None) -> int:
    metrics = _get(rt, f"/v1/runs/{run_id}/metrics", tenant)
    return int(metrics.get("last_step") or 0)


def _run_actors(rt: dict[str, Any], run_id: str) -> list[Any]:
    from ray.util.state import list_actors

    os.environ["RAY_AUTH_MODE"] = "token"
    actors = list_actors(
        address=f"http://127.0.0.1:{rt['dashboard']}",
        filters=[("state", "=", "ALIVE")],
        limit=10_000,
        detail=True,
    )
    prefix = f"run-{run_id}"
    return [a for a in actors if a.name and (a.name == prefix or a.name.startswith(prefix + "-"))]


def test_submitted_run_succeeds_with_gates_checkpoints_and_goodput(rt: dict[str, Any]) -> None:
    run_id = _submit(rt, steps=12)
    run = _wait(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    gates = {g["stage"]: g["status"] for g in run["stage_gates"]}
    assert gates == {"data_prep": "passed", "parallelism": "passed", "train": "passed"}
    # The train gate shows the layout its workers built, read back from their mesh:
    # the plan's.
    train = next(g for g in run["stage_gates"] if g["stage"] == "train")
    built = {dim: train["metrics"][f"layout_{dim}"] for dim in ("pp", "dp_shard", "cp", "tp")}
    assert built == {dim: float(run["plan"][dim]) for dim in built}
    ckpts = _get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    assert ckpts and max(c["step"] for c in ckpts) == 12
    assert all(Path(c["path"]).is_dir() for c in ckpts)
    metrics = _get(rt, f"/v1/runs/{run_id}/metrics")
    assert metrics["goodput"] > 0
    assert metrics["tokens_per_s"] > 0
    # Nothing of a finished run stays alive (Ray reaps its actors shortly after).
    wait_until(
        lambda: not _run_actors(rt, run_id),
        ACTORS_GONE_TIMEOUT_S,
        "every actor of the finished run gone",
    )


def test_ray_dashboard_keeps_token_auth(rt: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{rt['dashboard']}/api/v0/actors"
    assert httpx.get(url, timeout=10).status_code == 401
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    ok = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert ok.status_code == 200


def test_cancel_mid_run_stops_every_actor_within_30s_keeps_checkpoints_then_cleanup(
    rt: dict[str, Any],
) -> None:
    run_id = _submit(rt, steps=2000)
    _wait(
        rt, run_id, lambda r: r["state"] == "running" and _last_step(rt, run_id) >= 6, "a few steps"
    )
    assert any("trainer" in a.name for a in _run_actors(rt, run_id))
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
    _wait(rt, run_id, lambda r: r["state"] == "cancelled", "cancelled")
    wait_until(
        lambda: not _run_actors(rt, run_id),
        ACTORS_GONE_TIMEOUT_S,
        "every actor of the cancelled run gone",
    )
    ckpts = _get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    assert ckpts and all(Path(c["path"]).is_dir() for c in ckpts)

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
    assert _get(rt, f"/v1/runs/{run_id}")["state"] == "cleaned"
    assert _get(rt, f"/v1/bookings/{t.booking_id}/eligibility")["eligible"] is True


def test_replica_group_kill_is_an_interruption_and_the_run_still_succeeds(
    rt: dict[str, Any],
) -> None:
    # Long enough that the killed rank is back (a warm standby) before training ends.
    run_id = _submit(rt, steps=120)
    _wait(
        rt, run_id, lambda r: r["state"] == "running" and _last_step(rt, run_id) >= 3, "a few steps"
    )
    # The dashboard's actor list can trail the run's events on a loaded machine.
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (
        victims := [a for a in _run_actors(rt, run_id) if a.name.endswith("-trainer-rg1-rank0")]
    ):
        assert time.monotonic() < deadline, [a.name for a in _run_actors(rt, run_id)]
        time.sleep(0.5)
    os.kill(int(victims[0].pid), signal.SIGKILL)  # a real process kill
    _wait(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    metrics = _get(rt, f"/v1/runs/{run_id}/metrics")
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
    run_id = _submit(rt, steps=60)
    _wait(
        rt, run_id, lambda r: r["state"] == "running" and _last_step(rt, run_id) >= 5, "a few steps"
    )
    before = _get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]
    assert before
    be.kill()  # SIGKILL: no shutdown hook runs
    be.proc = None
    be.start()  # same DB, same var dir: the embedded Ray head and the driver live on
    run = _wait(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    after = _get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]
    after_keys = {(e["seq"], e["message"]) for e in after}
    assert all((e["seq"], e["message"]) in after_keys for e in before)
    # Reattached, not relaunched: the driver survived the API server.
    assert not any("driver lost" in e["message"] for e in after)
    assert run["state"] == "succeeded"


def test_lost_driver_is_relaunched_and_training_resumes_from_its_checkpoint(
    rt: dict[str, Any],
) -> None:
    run_id = _submit(rt, steps=40)
    _wait(
        rt,
        run_id,
        lambda r: r["state"] == "running" and _last_step(rt, run_id) >= 12,
        "a checkpoint",
    )
    assert _get(rt, f"/v1/runs/{run_id}/checkpoints")["checkpoints"]
    (driver,) = [a for a in _run_actors(rt, run_id) if a.name == f"run-{run_id}"]
    os.kill(int(driver.pid), signal.SIGKILL)  # the driver process dies (its trainers with it)
    run = _wait(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    logs = [e["message"] for e in _get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]]
    assert any("driver lost; relaunching (attempt 2)" in m for m in logs)
    assert any("stage data_prep: already passed" in m for m in logs)  # not redone
    assert any("resumed from checkpoint step" in m for m in logs), logs
    metrics = _get(rt, f"/v1/runs/{run_id}/metrics")
    assert metrics["interruptions"] >= 1 and metrics["last_step"] == 40
    assert {g["stage"]: g["status"] for g in run["stage_gates"]}["train"] == "passed"


def test_a_driver_lost_on_every_allowed_launch_fails_the_run_with_driver_lost(
    rt: dict[str, Any],
) -> None:
    """The relaunch limit: a run gets max_driver_attempts (2) launches; when the second
    driver dies too, the run fails with driver_lost instead of relaunching again."""
    run_id = _submit(rt, steps=400)
    pids: list[int] = []
    for attempt in (1, 2):
        _wait(
            rt,
            run_id,
            lambda r: (
                r["state"] == "running"
                and any(
                    a.name == f"run-{run_id}" and int(a.pid) not in pids
                    for a in _run_actors(rt, run_id)
                )
            ),
            f"driver of launch {attempt}",
        )
        (driver,) = [a for a in _run_actors(rt, run_id) if a.name == f"run-{run_id}"]
        pids.append(int(driver.pid))
        os.kill(int(driver.pid), signal.SIGKILL)
    run = _wait(rt, run_id, lambda r: r["state"] == "failed", "failed")
    assert run["state_reason"].startswith("driver_lost"), run["state_reason"]
    logs = [e["message"] for e in _get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]]
    assert sum("driver lost; relaunching" in m for m in logs) == 1, logs
    wait_until(
        lambda: not _run_actors(rt, run_id),
        ACTORS_GONE_TIMEOUT_S,
        "nothing of the failed run left running",
    )


def test_canary_secret_reaches_no_driver_or_worker_log(rt: dict[str, Any]) -> None:
    """The canary of tests/api/test_canary.py, once with the Ray runtime: planted in the
    API server's environment and sent as an idempotency key, it appears in no file of
    the backend's var dir (store, scratch, checkpoints), no Ray session log (driver,
    trainer and worker logs) and not in the server's log, after a run succeeded."""
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    canary = "sk-canary" + uuid.uuid4().hex
    be.stop()
    old_env = dict(be.env)
    be.env.update({"ITO_CANARY_TOKEN": canary, "OPENAI_API_KEY": canary})
    be.proc = None
    be.start()
    try:
        m = _manifest(rt, steps=10, name=f"run-{uuid.uuid4().hex[:6]}")
        with be.client() as c:
            ref = confirm_ref(c, t.approver, "train", t.booking_id, manifest=m)
            r = submit(c, t.submitter, t.booking_id, m, ref, canary)
            assert r.json()["error"]["code"] == "idempotency_key_invalid"
            assert canary not in r.text
        run_id = _submit(rt, steps=10)
        _wait(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    finally:
        be.stop()
        be.env = old_env
        be.proc = None
        be.start()
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
        run_id = _submit(
            rt,
            steps=36,
            loss_spike={"window": 10, "z_threshold": 6.0, "min_steps": 10, "skip_window_steps": 4},
        )
        run = _wait(rt, run_id, lambda r: r["state"] == "awaiting_approval", "awaiting_approval")
        (proposal,) = run["proposals"]
        assert proposal["status"] == "pending"
        assert proposal["params"]["from_step"] == 20
        assert "restart" in proposal["description"]
        paused_at = _last_step(rt, run_id)
        time.sleep(3.0)
        assert _last_step(rt, run_id) == paused_at  # nothing restarts or moves on its own
        assert _get(rt, f"/v1/runs/{run_id}")["state"] == "awaiting_approval"
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
        run = _wait(rt, run_id, lambda r: r["state"] == "succeeded", "succeeded")
        assert run["proposals"][0]["status"] == "approved"
        logs = _get(rt, f"/v1/runs/{run_id}/logs?limit=1000")["entries"]
        assert any("restored checkpoint step 20" in e["message"] for e in logs)
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
    deadline = time.monotonic() + timeout_s
    while (run := store.get_run(run_id))["state"] != state:
        assert time.monotonic() < deadline, (
            run["state"],
            run["state_reason"],
            rt["backend"].log_text()[-3000:],
        )
        time.sleep(0.5)
    return run


def _assert_torn_down(rt: dict[str, Any], run_id: str) -> None:
    deadline = time.monotonic() + 60
    while _run_actors(rt, run_id):  # the driver and every actor of its fleet are gone
        assert time.monotonic() < deadline, [a.name for a in _run_actors(rt, run_id)]
        time.sleep(0.5)


def test_a_running_run_stops_within_30s_of_its_booking_being_revoked(rt: dict[str, Any]) -> None:
    be: Backend = rt["backend"]
    t = make_tenant(be.db, "revokee", booking=cpu_booking_doc("bk-revokee", "revokee"))
    run_id = _submit(rt, steps=2000, tenant=t)
    _wait(
        rt,
        run_id,
        lambda r: r["state"] == "running" and _last_step(rt, run_id, t) >= 3,
        "a few steps",
        tenant=t,
    )
    assert any("trainer" in a.name for a in _run_actors(rt, run_id))
    admin(be.db, "bookings", "revoke", t.booking_id)  # the upstream revocation (mocked)
    revoked_at = Store(be.db).booking(t.booking_id)["updated_at"]  # type: ignore[index]
    run = _wait(rt, run_id, lambda r: r["state"] == "cancelled", "cancelled", tenant=t)
    assert run["state_reason"].startswith("booking_revoked: "), run["state_reason"]
    stopped_s = parse_iso(run["updated_at"]) - revoked_at
    print(f"booking revoked -> run cancelled in {stopped_s:.1f} s (run timestamps)")
    assert stopped_s <= 30.0
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
    running = _submit(rt, steps=2000, tenant=t)
    _wait(
        rt,
        running,
        lambda r: r["state"] == "running" and _last_step(rt, running, t) >= 2,
        "a few steps",
        tenant=t,
    )
    term_ends = _submit(rt, steps=20, tenant=t, booking_id="bk-lapse-2")
    disabled = _submit(rt, steps=20, tenant=t)
    for run_id in (term_ends, disabled):
        _wait(
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
    run_id = _submit(rt, steps=2000)
    _wait(
        rt, run_id, lambda r: r["state"] == "running" and _last_step(rt, run_id) >= 4, "a few steps"
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
    run = _wait(rt, run_id, lambda r: r["state"] == "cancelled", "cancelled")
    assert run["state_reason"].startswith("operator_stopped: operator test: abuse report")
    _assert_torn_down(rt, run_id)
    rows = Store(be.db).read(
        "SELECT * FROM audit_events WHERE action = 'admin:runs.stop' AND run_id = ?", (run_id,)
    )
    assert len(rows) == 1 and rows[0]["code"] == "operator_stopped"
