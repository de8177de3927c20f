"""Documented limits of following a run: `--follow` gives up after 5 transport failures
in a row, and an interrupted `ito` exits 130 with one envelope."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from client_world import World
from helpers.backend import free_port
from helpers.waiting import wait_until

from orchestrator.client.api import ItoClient
from orchestrator.client.cli import EXIT_OK, EXIT_TRANSPORT, run_cli
from orchestrator.client.transport import ClientSettings
from stages.errors import ErrorCode

pytestmark = pytest.mark.slow  # the session's real server subprocess

WAIT_S = 30.0


def test_follow_gives_up_after_the_documented_transport_failures() -> None:
    limit = ClientSettings().follow_max_transport_failures
    assert limit == 5  # docs/cli.md and the README say five
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every poll fails to connect
    updates: list[dict] = []
    sleeps: list[float] = []
    settings = ClientSettings(poll_interval_s=0.01, retry_backoff_s=0.0)
    with ItoClient(dead, "itok_x_y", settings=settings, sleep=sleeps.append) as client:
        env = client.follow_status("run_x", on_update=updates.append)
    assert env["ok"] is False and env["error"]["code"] == ErrorCode.api_unreachable
    assert len(updates) == limit  # one notice per failed poll, then it stops
    assert sleeps.count(0.01) == limit - 1  # a poll interval between failed polls


def test_follow_through_the_cli_exits_transport_after_the_limit(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("ITO_API_KEY", "itok_x_y")
    status, env = run_cli(
        [
            "status",
            "--run",
            "run_x",
            "--follow",
            "--poll-interval",
            "0.01",
            "--api-url",
            f"http://127.0.0.1:{free_port()}",
            "--json",
        ]
    )
    assert status == EXIT_TRANSPORT and env["error"]["code"] == "api_unreachable"
    assert json.loads(capsys.readouterr().out) == env


def test_sigint_during_follow_exits_130_with_one_envelope(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = world.confirm_train(monkeypatch)
    status, env = world.cli(monkeypatch, world.train_argv(ref, "sigint-key-01", "--json"))
    assert status == EXIT_OK, env
    run_id = env["data"]["run_id"]  # no runtime in these tests: it stays accepted

    def polls() -> int:  # the server's access log redacts ids: count the route
        return world.backend.log_text().count('"GET /v1/runs/{id} HTTP/1.1" 200')

    before = polls()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.client.cli",
            "status",
            "--run",
            run_id,
            "--follow",
            "--poll-interval",
            "0.2",
            "--json",
        ],
        env={**os.environ, "ITO_API_KEY": world.tenant.submitter, "ITO_API_URL": world.backend.url},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # SIGINT lands mid-follow: once the server has answered two of its polls.
        wait_until(
            lambda: polls() >= before + 2 or proc.poll() is not None,
            WAIT_S,
            "two status polls of the follower",
        )
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err  # 130, as a shell reports it
    lines = out.splitlines()
    assert len(lines) == 1, out
    assert json.loads(lines[0])["ok"] is False


def test_the_first_sigint_stops_the_next_wait_and_a_second_raises_at_once() -> None:
    from orchestrator.client.interrupt import StopRequest

    stop = StopRequest()
    stop.sleep(0.0)  # nothing asked yet: an ordinary wait
    stop.on_sigint(signal.SIGINT, None)  # a request in flight is not interrupted
    assert stop.requested
    with pytest.raises(KeyboardInterrupt):
        stop.sleep(3600.0)  # the follower's next poll interval ends at once
    with pytest.raises(KeyboardInterrupt):
        stop.on_sigint(signal.SIGINT, None)
