"""Two ``ito-backend serve`` on one host: a taken metrics port is refused at start with a
stable code that names the port and the flag, and ``--metrics-port 0`` picks a free port
and prints it. Real server processes on loopback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers.backend import STARTUP_TIMEOUT_S, free_port, start_backend

pytestmark = pytest.mark.slow  # real server subprocesses

_PRINTED = re.compile(r"metrics listener on http://127\.0\.0\.1:(\d+)/metrics")


def _serve_argv(tmp: Path, metrics_port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "orchestrator.admin",
        "serve",
        "--db",
        str(tmp / "ito.db"),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--var-dir",
        str(tmp / "var"),
        "--runtime",
        "none",
        "--no-planner-gate",
        "--metrics-port",
        str(metrics_port),
    ]


def test_a_taken_metrics_port_is_refused_with_the_port_and_the_flag(tmp_path: Path) -> None:
    first = start_backend(tmp_path / "first")
    try:
        second = subprocess.run(
            _serve_argv(tmp_path, first.metrics_port),
            capture_output=True,
            text=True,
            timeout=STARTUP_TIMEOUT_S * 2,
        )
        assert second.returncode == 1, second.stderr[-2000:]
        assert (
            f"error [address_in_use]: the metrics port 127.0.0.1:{first.metrics_port} "
            "is already in use" in second.stderr
        )
        assert "--metrics-port 0" in second.stderr
        assert "Traceback" not in second.stderr
        # The first server is unharmed.
        assert httpx.get(first.metrics_url, timeout=10.0).status_code == 200
    finally:
        first.stop()


def test_metrics_port_zero_picks_a_free_port_and_prints_it(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _serve_argv(tmp_path, 0), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        port = None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            m = _PRINTED.search(log.read_text(errors="replace"))
            port = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert port is not None and port != 0, log.read_text(errors="replace")[-2000:]
        # The printed port is the one that answers (the server may still be starting).
        answer = None
        while answer is None and time.monotonic() < deadline:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0)
            except httpx.HTTPError:
                time.sleep(0.1)
        assert answer is not None and answer.status_code == 200
        assert "ito_runs" in answer.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
