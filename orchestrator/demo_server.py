"""The demo's processes: ``ito`` / ``ito-backend`` commands run with ``--json`` for
their envelope, and the embedded server (``ito-backend serve`` with its Ray head)
started on free ports and waited for until it answers ``/healthz``. The demo and
``benchmarks/pipeline.py`` drive the product through these."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from orchestrator.runtime.ports import free_port

BIN = Path(sys.executable).parent
SERVER_START_TIMEOUT_S = 180.0
SERVER_START_ATTEMPTS = 2


def run_cli(args: list[str], env: dict[str, str], *, check: bool = True) -> dict[str, Any]:
    """Run one ito / ito-backend command with --json and return its envelope."""
    proc = subprocess.run(
        [str(BIN / args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        envelope: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(
            f"[demo] {args[0]} {args[1]} printed no envelope:\n{proc.stdout}\n{proc.stderr}"
        ) from None
    if check and not envelope.get("ok"):
        raise SystemExit(f"[demo] {' '.join(args[:2])} failed: {json.dumps(envelope)}")
    return envelope


def start_server(
    env: dict[str, str], db: Path, var_dir: Path, port: int
) -> subprocess.Popen[bytes]:
    """The embedded server on ``port``; its Ray head on free ports, so that the demo
    runs beside another server on the host (or a test's). A free port can be taken by
    another process before the head binds it: a server that exits while starting is
    started once more on fresh ports."""
    for attempt in range(SERVER_START_ATTEMPTS):
        try:
            return _start_once(env, db, var_dir, port)
        except ServerExited as e:
            if attempt + 1 == SERVER_START_ATTEMPTS:
                raise SystemExit(str(e)) from None
            print(f"{e}; starting it again on fresh ports", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


class ServerExited(Exception):
    """The server process ended before it answered /healthz."""


def _start_once(env: dict[str, str], db: Path, var_dir: Path, port: int) -> subprocess.Popen[bytes]:
    log = open(var_dir / "server.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [
            str(BIN / "ito-backend"),
            "serve",
            "--db",
            str(db),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--runtime",
            "ray",
            "--var-dir",
            str(var_dir / "server"),
            "--ray-head-port",
            str(free_port()),
            "--ray-dashboard-port",
            str(free_port()),
            "--ray-client-server-port",
            str(free_port()),
            "--ray-dashboard-agent-port",
            str(free_port()),
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
        ],  # any free port: one per host
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (var_dir / "server.log").read_text(errors="replace").strip().splitlines()
            raise ServerExited(
                f"[demo] server exited ({proc.returncode}); see {var_dir / 'server.log'}: "
                + " | ".join(tail[-3:])[-600:]
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("[demo] server did not become healthy in time")
