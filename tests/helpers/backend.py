"""``ito-backend serve`` as a real subprocess on a free port with a temp DB."""

from __future__ import annotations

import os
import resource
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from orchestrator.runtime.ports import free_port

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
# httpx loads the CA bundle into a new SSL context for every Client it builds (~50 ms of
# CPU): the polls here build one per request, several a second, so they share one.
TLS_CONTEXT = ssl.create_default_context()


@dataclass
class Backend:
    """One API server process. ``start()`` waits for /healthz; ``kill()`` is SIGKILL."""

    db: str | Path
    var_dir: Path
    log_path: Path
    port: int = 0
    # The Prometheus scrape's own listener (never the API port).
    metrics_port: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # Until /healthz answers; a server that starts its own Ray head needs longer.
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    # The server's descriptor limit (soft and hard), where a test needs a fixed one.
    nofile: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> Backend:
        for _ in range(3):  # a free port can be taken between probe and bind
            self.port = self.port or free_port()
            self.metrics_port = self.metrics_port or free_port()
            if self._spawn():
                return self
            self.port = self.metrics_port = 0
        raise RuntimeError(f"backend did not start; log:\n{self.log_text()[-4000:]}")

    def _spawn(self) -> bool:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.admin",
                "serve",
                "--db",
                str(self.db),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--var-dir",
                str(self.var_dir),
                # API tests need no Ray and isolate the other gates; a test that wants the
                # Ray runtime or the planner gate says so in extra_args (the last one wins).
                "--runtime",
                "none",
                "--no-planner-gate",
                "--metrics-port",
                str(self.metrics_port),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=None if self.nofile is None else self._limit_descriptors,
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if (
                    httpx.get(self.url + "/healthz", timeout=1.0, verify=TLS_CONTEXT).status_code
                    == 200
                ):
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        self.kill()
        return False

    def _limit_descriptors(self) -> None:
        assert self.nofile is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def restart(self) -> Backend:
        self.stop()
        self.proc = None
        return self.start()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def client(self, api_key: str | None = None, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        kw.setdefault("verify", TLS_CONTEXT)
        return httpx.Client(base_url=self.url, headers=headers, timeout=30.0, **kw)


def start_backend(tmp: Path, **kw: Any) -> Backend:
    """A started backend with its DB, var dir and log under ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    return Backend(
        db=tmp / "ito.db", var_dir=tmp / "var", log_path=tmp / "backend.log", **kw
    ).start()
