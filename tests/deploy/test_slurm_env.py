"""deploy/slurm checks every variable it takes from the environment before use.

The scripts run for real under bash with a hostile environment: a value built to
execute a command through bash arithmetic (``$((...))`` evaluates ``a[$(cmd)]``) or
to widen the booking's Ray resource JSON is refused (exit 64) before anything is
started, the planted command never runs and the value is not echoed. ``srun`` and
``ray`` are stand-ins that record their calls (no Slurm or Ray needed here); the
real Slurm run is tests/deploy/test_slurm.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
INVALID = 64
SCRIPT_TIMEOUT_S = 30


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """``srun`` and ``ray`` that append their argv (one JSON list a line) to calls.log."""
    d = tmp_path / "bin"
    d.mkdir()
    for name in ("srun", "ray"):
        exe = d / name
        exe.write_text(
            f"#!/bin/bash\n{sys.executable} -c 'import json, sys; "
            f'print(json.dumps(sys.argv[1:]))\' "$@" >> {tmp_path}/calls.log\n'
        )
        exe.chmod(0o755)
    return d


def _run(
    script: str, tmp: Path, bin_dir: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp),
        "ITO_RAY_BIN": str(bin_dir / "ray"),
    }
    return subprocess.run(
        ["bash", str(SLURM / script), *args],
        env={**base, **env},
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )


def _calls(tmp: Path) -> list[list[str]]:
    log = tmp / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


GOOD = {
    "ITO_BOOKING": "bk-1",
    "ITO_RAY_ADDRESS": "10.0.0.1:6379",
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NUM_NODES": "2",
    "ITO_PORT_BASE": "30000",
    "SLURM_CPUS_ON_NODE": "8",
    "SLURM_GPUS_ON_NODE": "8",
    "ITO_NODE_IP": "10.0.0.2",
}


def _hostile(marker: Path) -> dict[str, str]:
    run = f"a[$(touch {marker})]"
    return {
        "SLURM_JOB_ID": run,
        "ITO_PORT_BASE": run,
        "SLURM_JOB_NUM_NODES": run,
        "SLURM_GPUS_ON_NODE": run,
        "SLURM_CPUS_ON_NODE": run,
        "ITO_JOIN_TIMEOUT_S": run,
        "ITO_MARK_AMOUNT": run,
        "ITO_OBJECT_STORE_BYTES": "1$(touch " + str(marker) + ")",
        # Widens the booking's resource JSON to claim every node's CPUs.
        "ITO_BOOKING": 'bk-1": 8, "CPU": 100000, "x',
        "ITO_NODE_NAME": 'gpu-01": 1, "CPU": 100000, "x',
        "ITO_RAY_ADDRESS": "head:6379 --include-dashboard=true",
        "ITO_NODE_IP": "10.0.0.2; touch " + str(marker),
        "ITO_RAY_TEMP_DIR": "../../etc",
    }


@pytest.mark.parametrize("script", ["ray-booking.sbatch", "ray-node.sh"])
def test_every_hostile_variable_is_refused_before_anything_starts(
    script: str, tmp_path: Path, bin_dir: Path
) -> None:
    marker = tmp_path / "pwned"
    for name, value in _hostile(marker).items():
        r = _run(script, tmp_path, bin_dir, {**GOOD, name: value}, "worker")
        assert r.returncode == INVALID, (name, r.returncode, r.stderr)
        assert f"{name} is malformed" in r.stderr, r.stderr
        assert value not in r.stdout + r.stderr
        assert not marker.exists(), name
        assert _calls(tmp_path) == [], name  # neither srun nor ray was started


def test_out_of_range_port_base_is_refused(tmp_path: Path, bin_dir: Path) -> None:
    for base in ("80", "65500", "099999"):
        r = _run("ray-node.sh", tmp_path, bin_dir, {**GOOD, "ITO_PORT_BASE": base}, "worker")
        assert r.returncode == INVALID, (base, r.stderr)
    assert _calls(tmp_path) == []


def test_a_valid_environment_starts_the_node_with_well_formed_arguments(
    tmp_path: Path, bin_dir: Path
) -> None:
    r = _run("ray-node.sh", tmp_path, bin_dir, {**GOOD, "SLURMD_NODENAME": "gpu-01"}, "worker")
    assert r.returncode == 0, r.stderr
    (argv,) = _calls(tmp_path)
    resources = next(a for a in argv if a.startswith("--resources="))
    # The booking's mark, and the node's name as the booking lists it (Slurm's).
    assert json.loads(resources.removeprefix("--resources=")) == {
        "booking:bk-1": 8,
        "booking-node:gpu-01": 1,
    }
    assert "--node-manager-port=30010" in argv and "--max-worker-port=30069" in argv
    assert _run("ray-node.sh", tmp_path, bin_dir, GOOD, "rm -rf").returncode == INVALID


def test_wait_joined_checks_its_arguments(tmp_path: Path, bin_dir: Path) -> None:
    marker = tmp_path / "pwned"
    for args in (
        ("head:6379", "booking:bk-1", f"a[$(touch {marker})]"),
        ("head:6379; id", "booking:bk-1", "1"),
        ("head:6379", "booking:bk-1\"]; import os; os.system('id'); [\"", "1"),
    ):
        r = _run("wait-joined.sh", tmp_path, bin_dir, {}, *args)
        assert r.returncode == INVALID, (args, r.stderr)
        assert not marker.exists()


def test_the_runs_listeners_get_the_blocks_last_ports(tmp_path: Path) -> None:
    """Ray's workers inherit ITO_LISTEN_PORTS from ``ray start``: the block's last 30
    ports, past Ray's own worker ports."""
    d = tmp_path / "bin"
    d.mkdir()
    ray = d / "ray"
    ray.write_text(f'#!/bin/bash\necho "$ITO_LISTEN_PORTS" > {tmp_path}/ports\n')
    ray.chmod(0o755)
    r = _run("ray-node.sh", tmp_path, d, GOOD, "worker")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ports").read_text().strip() == "30070-30099"


def _firewall(tmp: Path, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return _run("run-ports-firewall.sh", tmp, bin_dir, {"SLURM_JOB_ID": "42", **env}, *args)


def test_the_firewall_rule_opens_the_runs_ports_to_the_jobs_nodes_only(
    tmp_path: Path, bin_dir: Path
) -> None:
    r = _firewall(tmp_path, bin_dir, "add", "10.0.0.2", "10.0.0.3", "fd00::3")
    assert r.returncode == 0, r.stderr
    rules = [line.strip() for line in r.stdout.splitlines()]
    # Job 42's default block is 24200: its runs' listeners are 24270-24299.
    assert "ip saddr { 10.0.0.2,10.0.0.3 } tcp dport 24270-24299 accept" in rules
    assert "ip6 saddr { fd00::3 } tcp dport 24270-24299 accept" in rules
    assert rules.index("tcp dport 24270-24299 drop") > rules.index(
        "ip saddr { 10.0.0.2,10.0.0.3 } tcp dport 24270-24299 accept"
    )
    assert r.stdout.startswith("table inet ito_job_42 {")
    custom = _firewall(tmp_path, bin_dir, "add", "10.0.0.2", ITO_PORT_BASE="30000")
    assert "tcp dport 30070-30099 drop" in custom.stdout
    gone = _firewall(tmp_path, bin_dir, "del")
    assert gone.stdout.strip() == "delete table inet ito_job_42"


def test_the_firewall_rule_refuses_a_malformed_address_or_none(
    tmp_path: Path, bin_dir: Path
) -> None:
    for args in (("add", "10.0.0.2 } accept; #"), ("add", "$(touch x)"), ("add",), ("open",)):
        r = _firewall(tmp_path, bin_dir, *args)
        assert r.returncode == INVALID, (args, r.stdout)
        assert "accept" not in r.stdout, args
    assert (
        _firewall(tmp_path, bin_dir, "add", "10.0.0.2", SLURM_JOB_ID="a[$(id)]").returncode
        == INVALID
    )


def test_the_node_starts_ray_with_only_the_allowlisted_environment(tmp_path: Path) -> None:
    """The job's environment may be the API server's (the self-contained variant): the
    store's URL and password, an API key and a token in it reach no Ray process; the
    names Ray's processes need do."""
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "ray"
    exe.write_text(
        f"#!/bin/bash\n{sys.executable} -c 'import json, os; "
        f"print(json.dumps(dict(os.environ)))' >> {tmp_path}/env.log\n"
    )
    exe.chmod(0o755)
    server = {
        "PGPASSWORD": "canary-pw",
        "PGPASSFILE": "/home/ito/.pgpass",
        "ITO_DB": "/shared/ito/ito.db",  # the script's checks take a path (SQLite)
        "ITO_DB_PASSWORD_FILE": "/run/secrets/db",
        "ITO_API_KEY": "ito_sk_canary",
        "HF_TOKEN": "hf_canary",
        "OMP_NUM_THREADS": "4",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    r = _run("ray-node.sh", tmp_path, d, {**GOOD, **server}, "worker")
    assert r.returncode == 0, r.stderr
    (env,) = [json.loads(line) for line in (tmp_path / "env.log").read_text().splitlines()]
    assert not {"PGPASSWORD", "PGPASSFILE", "ITO_DB", "ITO_DB_PASSWORD_FILE"} & set(env)
    assert not {"ITO_API_KEY", "HF_TOKEN", "ITO_BOOKING", "SLURM_JOB_ID"} & set(env)
    assert env["OMP_NUM_THREADS"] == "4" and env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["RAY_AUTH_MODE"] == "token" and env["ITO_LISTEN_PORTS"] == "30070-30099"
    assert env["ITO_NODE_IP"] == "10.0.0.2" and env["HOME"] == str(tmp_path)


def test_the_node_script_allows_the_names_the_backend_allows() -> None:
    """One allowlist, spelled twice: ray-node.sh's equals ray_cluster's."""
    from orchestrator.runtime.ray_cluster import RAY_ENV_NAMES, RAY_ENV_PREFIXES

    text = (SLURM / "ray-node.sh").read_text()

    def array(name: str) -> list[str]:
        body = re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE)
        assert body is not None, name
        return body.group(1).split()

    assert set(array("ray_env_names")) == RAY_ENV_NAMES
    assert tuple(array("ray_env_prefixes")) == RAY_ENV_PREFIXES
