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
    r = _run("ray-node.sh", tmp_path, bin_dir, GOOD, "worker")
    assert r.returncode == 0, r.stderr
    (argv,) = _calls(tmp_path)
    resources = next(a for a in argv if a.startswith("--resources="))
    assert json.loads(resources.removeprefix("--resources=")) == {"booking:bk-1": 8}
    assert "--node-manager-port=30010" in argv and "--max-worker-port=30099" in argv
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
