"""Connecting to Ray: the embedded local head, or an existing cluster.

The embedded default runs ``ray start --head --block`` as its own process session,
so the Ray cluster, and the detached RunDriver actors in it, outlive an API server
crash: a restarted server reattaches to live drivers by name. ``--ray-address``
joins a cluster that deploy/slurm or KubeRay started instead.

Token authentication stays on (``RAY_AUTH_MODE=token``). The token lives in
``~/.ray/auth_token`` of the user that runs the backend; an SRE gets it with
``ray get-auth-token`` on the head node and opens the dashboard with it.

Secrets stay with the server. The head (GCS, raylet, dashboard) and through it every
Ray worker (the drivers, the trainer ranks, the rollout workers and whatever they
start) get only the environment variables named in ``RAY_ENV_NAMES`` and
``RAY_ENV_PREFIXES`` (``ray_environment``): an allowlist, so the store's credentials
(``PGPASSWORD``, ``PGPASSFILE``, ``ITO_DB``, ``ITO_DB_PASSWORD_FILE``), API keys and
whatever secret an operator adds to the server's environment later never reach a
Ray process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from stages.errors import ErrorCode, ItoError

RAY_NAMESPACE = "ito"
# Ray reads its auth mode when it is imported: set it before anything imports ray.
_RAY_IMPORTED_EARLY = "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != "token"
os.environ["RAY_AUTH_MODE"] = "token"


class RaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # None: start (or reuse) the embedded local head described by the fields below.
    address: str | None = None
    head_port: int = Field(default=6390, gt=0, lt=65536)
    dashboard_port: int = Field(default=8265, gt=0, lt=65536)
    num_cpus: int | None = Field(default=None, gt=0)
    include_dashboard: bool = True
    # Custom resources the embedded head is marked with: the bookings it serves
    # (``booking:<id>``, see orchestrator/runtime/placement.py). Set by the supervisor.
    node_resources: dict[str, float] = Field(default_factory=dict)
    # Ray Client's port on the embedded head (bound to loopback like every other).
    client_server_port: int = Field(default=10001, gt=0, lt=65536)
    # The dashboard agent's HTTP port on the head's node; 0: any free port. Two heads on
    # one host (two servers, or CI's test workers) need distinct ports here and above.
    dashboard_agent_listen_port: int = Field(default=52365, ge=0, lt=65536)
    # Waiting for a freshly started head to accept connections.
    head_start_timeout_s: float = Field(default=90.0, gt=0)


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


# The environment variables a Ray process gets from the server's, by name: what Ray,
# Python, torch and the stages read. Nothing that carries a credential: the store's
# URL and password (``ITO_DB``, ``ITO_DB_PASSWORD_FILE``, ``PGPASSWORD``, ``PGPASSFILE``
# and every other ``PG*``), API keys, ``HF_TOKEN`` stay with the server. The launch key
# is named by a path (``ITO_LAUNCH_KEY_FILE``): drivers verify their tickets and ranks
# seal checkpoints with the file's key, which every Ray node reads anyway.
RAY_ENV_NAMES: frozenset[str] = frozenset(
    {
        # the OS and Python a process runs in
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        # threads of torch, BLAS and tokenizers on a rank's CPU share
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        # accelerators
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
        "CUBLAS_WORKSPACE_CONFIG",
        "PYTORCH_CUDA_ALLOC_CONF",
        # model and data caches (runs are offline)
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "XDG_CACHE_HOME",
        # the backend's own settings that stages read on a node
        "ITO_LAUNCH_KEY_FILE",  # a path; see above
        "ITO_CONFIGS_DIR",
        "ITO_DATA_CACHE",
        "ITO_NODE_IP",
        "ITO_LISTEN_PORTS",
    }
)
# Families of settings Ray, the locale, CUDA, NCCL, gloo and torch read by prefix (an
# interface, a timeout, Ray's own config and token: what a Ray process needs).
RAY_ENV_PREFIXES: tuple[str, ...] = ("RAY_", "LC_", "CUDA_", "NCCL_", "GLOO_", "TORCH_")


def ray_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a Ray process of the backend starts with: the allowlisted
    names of ``environ`` (the server's), and Ray's settings below."""
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k in RAY_ENV_NAMES or k.startswith(RAY_ENV_PREFIXES)}
    env["RAY_AUTH_MODE"] = "token"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # On SIGTERM a `ray start --block` node first waits up to 30 s for its GCS to drain
    # it (for Ray Serve's proxies, which the backend never runs): stopping the head
    # would cost those 30 s every time. Its processes still get the SIGTERM.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    return env


# Every process the backend starts for Ray (the head, hence every raylet worker: the
# drivers, trainers and data prep tasks that write run scratch) creates files private
# to the backend's user.
PRIVATE_UMASK = 0o077


def auth_token_path() -> Path:
    """Where Ray reads its cluster token (``ray get-auth-token`` prints it)."""
    return Path.home() / ".ray" / "auth_token"


def ensure_auth_token() -> Path:
    """Create ~/.ray/auth_token if missing (token auth is never turned off) and keep
    it 0600 in a 0700 folder: Ray writes it with the caller's umask (0644 by default),
    and whoever reads it may run code on every node of the cluster."""
    path = auth_token_path()
    _private_dir(path.parent, parents=True)
    if not (path.is_file() and path.stat().st_size > 0):
        _generate_auth_token()
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise ItoError(ErrorCode.ray_unavailable, "the Ray token file is not ours")
    os.chmod(path, 0o600)
    return path


def _generate_auth_token() -> None:
    # A `ray` CLI process (seconds of imports): only when there is no token yet.
    subprocess.run(
        [_ray_bin(), "get-auth-token", "--generate"],
        env=ray_environment(),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=60,
        umask=PRIVATE_UMASK,
    )


def head_pid_file(var_dir: Path) -> Path:
    return var_dir / "ray-head.pid"


def ray_private_root(var_dir: Path) -> Path:
    """The 0700 folder the embedded head's temp dir lives in. Ray opens the temp dir
    it is given (and its session folders) to 0777 whenever it creates them; this
    parent is never handed to Ray, so it stays 0700 and nobody else reaches anything
    below it, at any moment. Short, because Ray's unix sockets live below it (a
    socket path must fit in 107 bytes)."""
    tag = hashlib.sha256(str(var_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"ito-ray-{os.geteuid()}-{tag}"


def ray_temp_dir(var_dir: Path) -> Path:
    """The embedded head's ``--temp-dir`` (sessions, logs, sockets)."""
    return ray_private_root(var_dir) / "r"


def _private_dir(path: Path, *, parents: bool = False) -> Path:
    if parents:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ItoError(
            ErrorCode.ray_unavailable,
            f"{path.name}: a private folder of the backend is not a folder it owns",
        )
    os.chmod(path, 0o700)
    return path


def _alive(pid: int) -> bool:
    """Running: not gone and not a zombie (a head this process started and that has
    exited stays a zombie until reaped, and ``kill(pid, 0)`` still succeeds on it)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # our child, exited: reaped now
    except ChildProcessError:
        pass  # not our child
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def start_local_head(var_dir: Path, settings: RaySettings) -> str:
    """Start the embedded head unless ours is already running; return its address."""
    ensure_auth_token()
    address = f"127.0.0.1:{settings.head_port}"
    pid_file = head_pid_file(var_dir)
    if pid_file.exists() and _alive(int(pid_file.read_text() or 0)):
        return address
    private_var_dir(var_dir)
    _private_dir(ray_private_root(var_dir))
    temp = _private_dir(ray_temp_dir(var_dir))
    # Loopback only: the node's address, the dashboard and Ray Client (which would
    # otherwise listen on all interfaces) are bound to 127.0.0.1.
    cmd = [
        _ray_bin(),
        "start",
        "--head",
        "--block",
        f"--port={settings.head_port}",
        "--node-ip-address=127.0.0.1",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
        f"--ray-client-server-port={settings.client_server_port}",
        f"--include-dashboard={str(settings.include_dashboard).lower()}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={settings.dashboard_port}",
        f"--dashboard-agent-listen-port={settings.dashboard_agent_listen_port}",
    ]
    if settings.num_cpus:
        cmd.append(f"--num-cpus={settings.num_cpus}")
    if settings.node_resources:
        cmd.append(f"--resources={json.dumps(settings.node_resources, sort_keys=True)}")
    log = open(var_dir / "ray-head.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        cmd,
        env=ray_environment(),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        umask=PRIVATE_UMASK,
    )
    pid_file.write_text(str(proc.pid))
    deadline = time.monotonic() + settings.head_start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ItoError(
                ErrorCode.ray_unavailable,
                f"ray head exited with {proc.returncode}; see {var_dir}/ray-head.log",
            )
        if b"Ray runtime started" in (var_dir / "ray-head.log").read_bytes()[-20000:]:
            os.chmod(temp, 0o700)  # Ray opens its temp root to 0777; nobody else needs it
            return address
        time.sleep(0.25)
    raise ItoError(ErrorCode.ray_unavailable, "ray head did not start in time")


def private_var_dir(var_dir: Path) -> Path:
    """The backend's scratch root (run scratch holds cleaned tenant data, the launch
    key lives here): 0700 and ours, with ``runs/`` below it 0700 too."""
    _private_dir(var_dir, parents=True)
    _private_dir(var_dir / "runs")
    return var_dir


def stop_local_head(var_dir: Path, timeout_s: float = 30.0) -> bool:
    """Stop the embedded head we started (never any other Ray on the machine)."""
    pid_file = head_pid_file(var_dir)
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text() or 0)
    if pid and _alive(pid):
        os.killpg(pid, signal.SIGTERM)  # `ray start --block` stops its children on SIGTERM
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return True


def connect(var_dir: Path, settings: RaySettings) -> str:
    """``ray.init`` this process into the cluster (namespace ``ito``); return the address."""
    import ray

    if _RAY_IMPORTED_EARLY:
        raise ItoError(
            ErrorCode.ray_unavailable,
            "ray was imported before token auth was "
            "configured; import orchestrator.runtime.ray_cluster first",
        )
    address = settings.address or start_local_head(var_dir, settings)
    if not ray.is_initialized():
        # ray.init (on the main thread) replaces SIGTERM's handler with a bare
        # ``sys.exit``: the server's own one (stop accepting, let requests finish within
        # the grace) must stay.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(
                address=address,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except ConnectionError as e:
            raise ItoError(ErrorCode.ray_unavailable, f"cannot reach Ray at {address}") from e
        finally:
            if on_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)
    return address
