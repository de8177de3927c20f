"""Lost answers and revoked keys, through a real loopback proxy in front of the real
server: the client finds its run by idempotency key (one run, never two), and
following stops at the first ``credential_revoked`` without another request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from client_proxy import RecordingProxy
from client_world import World
from helpers.tenants import admin
from helpers.waiting import wait_until

from orchestrator.client.api import ItoClient
from orchestrator.client.cli import EXIT_AUTH, EXIT_OK, EXIT_TRANSPORT
from orchestrator.client.manifest_reader import read_manifest
from orchestrator.client.transport import ClientSettings
from stages.errors import ErrorCode

pytestmark = pytest.mark.slow  # real server subprocess, proxy threads, CLI subprocesses

WAIT_S = 30.0


def _first_post(action: str):
    def decide(method: str, path: str, _n: int) -> str:
        first = method == "POST" and not decide.done  # type: ignore[attr-defined]
        if first:
            decide.done = True  # type: ignore[attr-defined]
            return action
        return "forward"

    decide.done = False  # type: ignore[attr-defined]
    return decide


def _train(world: World, proxy: RecordingProxy, ref: str, key: str) -> dict:
    # A 3 s total timeout: "hold" (an answer that never comes) ends as a read timeout.
    settings = ClientSettings(retry_backoff_s=0.0, total_timeout_s=3.0)
    with ItoClient(proxy.url, world.tenant.submitter, settings=settings) as client:
        return client.train(world.booking, read_manifest(str(world.manifest)), ref, key)


def _trail(proxy: RecordingProxy) -> list[tuple[str, str, str]]:
    return [
        (
            r.method,
            r.path.split("?")[0] + ("?key" if "idempotency_key=" in r.path else ""),
            r.action,
        )
        for r in proxy.requests
    ]


@pytest.mark.parametrize("action", ["drop", "502", "hold"])
def test_lost_answer_run_found_by_key(
    world: World, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    ref = world.confirm_train(monkeypatch)
    with RecordingProxy(world.backend.port, _first_post(action)) as proxy:
        env = _train(world, proxy, ref, f"lost-{action}-0001")
        # The server did create the run (it answered 200 to the proxy)...
        assert proxy.requests[0].status == 200
        # ...the client looked it up by key and did not POST again.
        assert _trail(proxy) == [("POST", "/v1/runs", action), ("GET", "/v1/runs?key", "forward")]
    assert env["ok"] is True and env["live_api_contacted"] is True
    assert env["data"]["replayed"] is True
    assert env["data"]["idempotency_key"] == f"lost-{action}-0001"
    assert world.runs_for_booking() == [(env["data"]["run_id"], f"lost-{action}-0001")]


def test_request_lost_before_the_server_is_retried_after_lookup(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = world.confirm_train(monkeypatch)
    with RecordingProxy(world.backend.port, _first_post("refuse")) as proxy:
        env = _train(world, proxy, ref, "refused-00001")
        assert _trail(proxy) == [
            ("POST", "/v1/runs", "refuse"),  # connection closed: maybe sent, maybe not
            ("GET", "/v1/runs?key", "forward"),  # so look first: absent
            ("POST", "/v1/runs", "forward"),  # then retry with the same key
        ]
    assert env["ok"] is True and env["data"]["replayed"] is False
    assert world.runs_for_booking() == [(env["data"]["run_id"], "refused-00001")]


def test_no_blind_retry_when_the_lookup_fails_too(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    ref = world.confirm_train(monkeypatch)
    with RecordingProxy(world.backend.port, lambda _m, _p, _n: "drop") as proxy:
        argv = world.train_argv(ref, "blind-key-001", "--json")
        status, env = world.cli(monkeypatch, argv, url=proxy.url)
        posts = proxy.matching("POST", "/v1/runs")
        lookups = proxy.matching("GET", "/v1/runs?idempotency_key=blind-key-001")
    assert status == EXIT_TRANSPORT
    assert env["error"]["code"] == ErrorCode.ambiguous_transport_failure
    assert len(posts) == 1 and len(lookups) >= 2  # looked repeatedly, never re-submitted
    assert [k for _, k in world.runs_for_booking()] == ["blind-key-001"]
    # Once the network is back, the same command finds the run.
    status, env = world.cli(monkeypatch, argv)
    assert status == EXIT_OK and env["data"]["replayed"] is True
    assert len(world.runs_for_booking()) == 1
    capsys.readouterr()


def _wait(pred, what: str) -> None:
    wait_until(pred, WAIT_S, what)


@pytest.mark.parametrize(
    "follow",
    [["status", "--follow", "--json"], ["status", "--follow"], ["logs", "--follow", "--json"]],
)
def test_key_revoked_while_following(
    world: World, monkeypatch: pytest.MonkeyPatch, follow: list[str]
) -> None:
    ref = world.confirm_train(monkeypatch)
    status, env = world.cli(
        monkeypatch,
        world.train_argv(ref, "follow-key-001", "--json"),
    )
    assert status == EXIT_OK
    run_id = env["data"]["run_id"]  # stays `accepted` (no runtime): polling goes on
    with RecordingProxy(world.backend.port) as proxy:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.client.cli",
                follow[0],
                "--run",
                run_id,
                *follow[1:],
                "--poll-interval",
                "0.3",
                "--api-url",
                proxy.url,
            ],
            env={**os.environ, "ITO_API_KEY": world.tenant.submitter},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait(lambda: len(proxy.requests) >= 3, "three polls")
            admin(world.backend.db, "keys", "revoke", world.tenant.key_ids["submitter"])
            revoked_at = time.monotonic()
            out, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        after = [r for r in proxy.requests if r.arrived > revoked_at]
        statuses = [r.status for r in proxy.requests]
    assert proc.returncode == EXIT_AUTH, (out, err)
    # It stopped at the first 401: every earlier answer was 200, nothing came after it,
    # and at most one request started after the revocation (the next poll).
    assert statuses[-1] == 401 and all(s == 200 for s in statuses[:-1]), statuses
    assert len(after) <= 1
    if "--json" in follow:
        lines = out.splitlines()
        assert len(lines) == 1
        assert json.loads(lines[0])["error"]["code"] == ErrorCode.credential_revoked
    else:
        assert "error [credential_revoked] (server)" in err
        assert "state=accepted" in out  # progress was shown while it lasted
