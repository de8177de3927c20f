"""Progress and proposals through the CLI, with the run driven the way the supervisor
drives it: state transitions and driver events persisted in the real store (no Ray
driver here; the runtime is exercised by its own tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from client_world import World

from orchestrator.client.cli import EXIT_OK
from orchestrator.db.store import Store
from stages.events import ProposalEvent, StepEvent

pytestmark = pytest.mark.slow

WAIT_S = 30.0


@pytest.fixture
def store(world: World) -> Iterator[Store]:
    s = Store(world.backend.db)
    yield s
    s.close()


def _submit(world: World, monkeypatch: pytest.MonkeyPatch, key: str) -> str:
    ref = world.confirm_train(monkeypatch)
    status, env = world.cli(
        monkeypatch,
        world.train_argv(ref, key, "--json"),
    )
    assert status == EXIT_OK, env
    run_id: str = env["data"]["run_id"]
    return run_id


def _steps(first: int, last: int, loss0: float) -> list[dict]:
    return [
        {
            "seq": n,
            **StepEvent(
                step=n, loss=loss0 / n, tokens=512, seconds=0.1, committed=True
            ).model_dump(),
        }
        for n in range(first, last + 1)
    ]


def test_follow_shows_state_step_and_loss_until_success(
    world: World, monkeypatch: pytest.MonkeyPatch, store: Store
) -> None:
    run_id = _submit(world, monkeypatch, "progress-key-01")
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
        ],
        env={**os.environ, "ITO_API_KEY": world.tenant.submitter, "ITO_API_URL": world.backend.url},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not any(text in ln for ln in lines):
            assert time.monotonic() < deadline, (text, lines)
            time.sleep(0.05)

    try:
        wait_for("state=accepted")
        store.transition(run_id, "starting")
        store.transition(run_id, "running")
        store.ingest_events(run_id, _steps(1, 4, 10.0))
        wait_for("state=running step=4 loss=2.5000")
        store.transition(run_id, "succeeded", "all gates passed")
        proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(WAIT_S)
    assert proc.returncode == EXIT_OK, proc.stderr.read()  # type: ignore[union-attr]
    text = "".join(lines)
    assert text.index("state=accepted") < text.index("state=running") < text.index("succeeded")


def test_approve_and_decline_proposals(
    world: World, monkeypatch: pytest.MonkeyPatch, store: Store, capsys
) -> None:
    run_id = _submit(world, monkeypatch, "proposal-key-01")
    store.transition(run_id, "starting")
    store.transition(run_id, "running")
    store.ingest_events(
        run_id,
        [
            {
                "seq": 1,
                **ProposalEvent(
                    proposal_id=pid,
                    action="restart_from_checkpoint",
                    description="loss spike at step 40",
                    params={"step": 30},
                ).model_dump(),
            }
            for pid in ("prop-a",)
        ],
    )
    _, env = world.cli(monkeypatch, ["status", "--run", run_id, "--json"])
    assert [p["proposal_id"] for p in env["data"]["proposals"]] == ["prop-a"]

    def decide(decision: str, pid: str, key: str) -> tuple[int, dict]:
        _, conf = world.cli(
            monkeypatch,
            [
                "confirm",
                "--action",
                "restart",
                "--booking",
                world.booking,
                "--run",
                run_id,
                "--proposal",
                pid,
                "--json",
            ],
            key=world.tenant.approver,
        )
        assert conf["ok"], conf
        return world.cli(
            monkeypatch,
            [
                decision,
                "--run",
                run_id,
                "--proposal",
                pid,
                "--confirmation-ref",
                conf["data"]["confirmation_ref"],
                "--idempotency-key",
                key,
                "--json",
            ],
        )

    status, env = decide("approve", "prop-a", "approve-key-01")
    assert status == EXIT_OK, env
    assert [p["status"] for p in env["data"]["proposals"]] == ["approved"]
    store.ingest_events(
        run_id,
        [
            {
                "seq": 2,
                **ProposalEvent(
                    proposal_id="prop-b",
                    action="restart_from_checkpoint",
                    description="another spike",
                ).model_dump(),
            }
        ],
    )
    status, env = decide("decline", "prop-b", "decline-key-01")
    assert status == EXIT_OK, env
    statuses = {p["proposal_id"]: p["status"] for p in env["data"]["proposals"]}
    assert statuses == {"prop-a": "approved", "prop-b": "declined"}
    capsys.readouterr()
