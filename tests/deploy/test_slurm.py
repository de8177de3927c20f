"""A real single-node Slurm (Debian's slurm-wlm + munge, on loopback) runs
deploy/slurm/ito-self-contained.sbatch: the Ray head, the API server and the
booking's Ray node start inside the allocation; a tiny run submitted through the API
succeeds with its actors on the Slurm-started node marked with the booking; then
``scancel`` tears everything down. Skipped unless root with slurm-wlm and munge
installed (``scripts/test.sh`` installs them). Only GPUs are absent.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import free_port
from helpers.flows import submit_run
from helpers.manifests import cpu_testbed_manifest, data_ref
from helpers.ray_backend import python_docs_corpus
from helpers.tenants import Tenant, cpu_booking_doc, make_tenant
from helpers.tools import require, require_root

# Above pytest's 300 s default: job start, run and teardown each have a deadline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "deploy" / "slurm"
DAEMON_TIMEOUT_S = 60.0
JOB_START_TIMEOUT_S = 240.0
RUN_TIMEOUT_S = 300.0
TEARDOWN_TIMEOUT_S = 90.0

require("slurm", "slurmctld", "slurmd", "munged", "sbatch", allow_module_level=True)
require_root("the Slurm and munge daemons", allow_module_level=True)


def _run(*cmd: str, env: dict[str, str], timeout: float = 30.0) -> str:
    return subprocess.run(
        cmd, env=env, check=True, capture_output=True, text=True, timeout=timeout
    ).stdout.strip()


def _queued(job: str, env: dict[str, str]) -> bool:
    """Whether the job is still known to squeue (an ended job id is an error there)."""
    r = subprocess.run(
        ["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, timeout=30
    )
    return r.returncode == 0 and bool(r.stdout.strip())


def _port_block() -> int:
    """A base port with 100 free ports after it (the job's documented block)."""
    for _ in range(50):
        base = random.randrange(30000, 59000, 100)
        try:
            for p in range(base, base + 100):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of 100 ports")


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, Any]]:
    d = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))  # short: unix sockets
    d.chmod(0o755)  # munged (user munge) must traverse it to its socket folder
    procs: list[subprocess.Popen[bytes]] = []
    munge_dir = d / "munge"
    munge_dir.mkdir()
    shutil.chown(munge_dir, "munge", "munge")
    munge_dir.chmod(0o755)
    socket_path = munge_dir / "munge.socket.2"
    host = socket.gethostname().split(".")[0]
    mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=ito-ci",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "AuthType=auth/munge",
                "CryptoType=crypto/munge",
                f"AuthInfo=socket={socket_path}",
                "MpiDefault=none",
                "MailProg=/bin/true",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                f"StateSaveLocation={d}/state",
                f"SlurmdSpoolDir={d}/spool",
                f"SlurmctldPidFile={d}/slurmctld.pid",
                f"SlurmdPidFile={d}/slurmd.pid",
                f"SlurmctldLogFile={d}/slurmctld.log",
                f"SlurmdLogFile={d}/slurmd.log",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} "
                f"RealMemory={mem_mb} State=UNKNOWN",
                f"PartitionName=ci Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def spawn(*cmd: str) -> None:
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        )

    try:
        spawn(
            "runuser",
            "-u",
            "munge",
            "--",
            "/usr/sbin/munged",
            "-F",
            f"--socket={socket_path}",
            f"--pid-file={munge_dir}/munged.pid",
            f"--log-file={munge_dir}/munged.log",
            f"--seed-file={munge_dir}/munged.seed",
        )
        deadline = time.monotonic() + DAEMON_TIMEOUT_S
        while not socket_path.exists():
            assert time.monotonic() < deadline, "munged did not start"
            time.sleep(0.2)
        spawn("slurmctld", "-D", "-f", str(conf))
        spawn("slurmd", "-D", "-f", str(conf))
        while (
            "idle"
            not in subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True
            ).stdout
        ):
            assert time.monotonic() < deadline, (d / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield {"dir": d, "env": env}
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        deadline = time.monotonic() + TEARDOWN_TIMEOUT_S
        while subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True).returncode == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def _manifest(tmp: Path) -> dict[str, Any]:
    corpus = python_docs_corpus(tmp / "train.jsonl", 200)
    return cpu_testbed_manifest(
        [data_ref(corpus, license="PSF")],
        tmp / "ckpt",
        steps=30,
        name=f"slurm-{uuid.uuid4().hex[:6]}",
        interval_steps=10,
    )


def test_sbatch_self_contained_run_and_scancel_teardown(
    slurm: dict[str, Any], tmp_path: Path
) -> None:
    var = tmp_path / "var"
    db = tmp_path / "ito.db"
    tenant: Tenant = make_tenant(db, "acme", booking=cpu_booking_doc("bk-slurm", "acme", gpus=1))
    base = _port_block()
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    backend = tmp_path / "ito-backend"
    backend.write_text(f'#!/bin/sh\nexec {sys.executable} -m orchestrator.admin "$@"\n')
    backend.chmod(0o755)
    env = {
        **slurm["env"],
        "ITO_BOOKING": "bk-slurm",
        "ITO_DB": str(db),
        "ITO_VAR_DIR": str(var),
        "ITO_BACKEND_BIN": str(backend),
        "ITO_PORT_BASE": str(base),
        "ITO_NODE_IP": "127.0.0.1",
        "ITO_RAY_BIN": str(Path(sys.executable).with_name("ray")),
        "ITO_PYTHON": sys.executable,
        "ITO_SLURM_DIR": str(SLURM_DIR),
        "ITO_RAY_TEMP_DIR": str(ray_tmp),
        "ITO_OBJECT_STORE_BYTES": "200000000",
        "ITO_TRAIN_OVERRIDES": json.dumps({"pace_step_s": 0.1}),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    out = tmp_path / "job.out"
    job = _run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        f"--output={out}",
        str(SLURM_DIR / "ito-self-contained.sbatch"),
        env=env,
    )

    def job_log() -> str:
        return out.read_text(errors="replace")[-4000:] if out.exists() else "(no output)"

    try:
        api_url_file = var / "api-url"
        deadline = time.monotonic() + JOB_START_TIMEOUT_S
        while not api_url_file.exists():
            assert _queued(job, env), f"job ended early:\n{job_log()}"
            assert time.monotonic() < deadline, f"the job did not come up:\n{job_log()}"
            time.sleep(0.25)
        url = api_url_file.read_text().strip()
        m = _manifest(tmp_path)
        with httpx.Client(base_url=url, timeout=30) as c:
            run_id = submit_run(c, tenant, "bk-slurm", m)
        placed = _watch_run(url, tenant, run_id, f"http://127.0.0.1:{base + 8}", job_log)
        assert placed and set(placed.values()) == {"booking:bk-slurm"}, placed
        assert f"run-{run_id}" in placed and f"run-{run_id}-lighthouse" in placed
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)
    deadline = time.monotonic() + TEARDOWN_TIMEOUT_S
    while _queued(job, env):
        assert time.monotonic() < deadline, "the job did not end after scancel"
        time.sleep(0.25)
    # Clean teardown: no Ray process of this job and no API server are left.
    while (
        subprocess.run(["pgrep", "-f", "--", str(ray_tmp)], capture_output=True).returncode == 0
        or subprocess.run(["pgrep", "-f", "--", f"--var-dir {var}"], capture_output=True).returncode
        == 0
    ):
        assert time.monotonic() < deadline, f"processes left after scancel:\n{job_log()}"
        time.sleep(0.25)
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/healthz", timeout=2)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _watch_run(
    url: str, tenant: Tenant, run_id: str, dashboard: str, job_log: Any
) -> dict[str, str]:
    """Follow the run to success; return actor name -> booking mark of its node."""
    from ray.util.state import list_actors, list_nodes

    os.environ["RAY_AUTH_MODE"] = "token"
    placed: dict[str, str] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with httpx.Client(
            base_url=url, timeout=30, headers={"Authorization": f"Bearer {tenant.submitter}"}
        ) as c:
            run = c.get(f"/v1/runs/{run_id}").json()["data"]
        if run["state"] in ("succeeded", "failed", "cancelled"):
            break
        if run["state"] == "running":
            try:
                marks = {
                    n.node_id: next((k for k in n.resources_total if k.startswith("booking:")), "")
                    for n in list_nodes(address=dashboard, detail=True)
                }
                for a in list_actors(
                    address=dashboard, filters=[("state", "=", "ALIVE")], detail=True
                ):
                    if a.name and a.name.startswith(f"run-{run_id}"):
                        placed[a.name] = marks.get(a.node_id or "", "?")
            except Exception:  # the state API can lag under load; sample again
                pass
        time.sleep(0.25)
    assert run.get("state") == "succeeded", f"{run}\n{job_log()}"
    return placed
