"""Secrets stay with the server: no Ray process of a running run holds the database
password or another server secret in its environment.

The real server path: ``ito-backend serve --runtime ray`` on a real PostgreSQL store
(tests/helpers/postgres.py), its password in the server's environment as
``PGPASSWORD`` (and its file's path as ``ITO_DB_PASSWORD_FILE``), beside an API key
and a Hugging Face token. The server starts its embedded Ray head; a run is submitted
and trains; then every process of the head's session and process tree (GCS, raylet,
dashboard and its agent, the run's driver, its trainer ranks and every other worker)
has its ``/proc/<pid>/environ`` read. Nothing is mocked.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from helpers.postgres import PgServer
from helpers.testbed_runs import last_step, paced_backend, run_actors, submit_testbed
from helpers.waiting import wait_until
from helpers.xdist_groups import module_group

from orchestrator.runtime import ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), module_group(__name__)]
# Bound on the run reaching its first trained step (a server, a Ray head and a driver
# start on a loaded 2-core host); a hang guard, never a speed claim.
TRAINING_TIMEOUT_S = 400.0
# Paced steps: the run is still training while its processes are read.
STEPS = 200


def _tree(root: int) -> set[int]:
    """``root``, its session's processes and every descendant of it."""
    session = subprocess.run(
        ["ps", "-o", "pid=", "-s", str(root)], capture_output=True, text=True, check=False
    ).stdout
    pids = {int(p) for p in session.split()} | {root}
    children: dict[int, set[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, set()).add(int(stat.parent.name))
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), set()) - pids:
            pids.add(child)
            todo.append(child)
    return pids


def _environ(pid: int) -> tuple[str, dict[str, str]] | None:
    """(its command line, its environment) as the kernel holds them."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None  # exited since the listing
    env = dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)
    return cmdline.replace(b"\0", b" ").decode(errors="replace"), env


def test_no_ray_process_of_a_run_holds_the_database_password_or_a_server_secret(
    pg_server: PgServer, tmp_path: Path
) -> None:
    url = pg_server.new_database()
    password = pg_server.password_file.read_text().strip()
    token = "canary" + uuid.uuid4().hex
    server_env = {
        "PGPASSWORD": password,  # libpq's way; the store reads it from here too
        "ITO_DB": url,
        "ITO_API_KEY": "ito_sk_" + token,
        "HF_TOKEN": "hf_" + token,
    }
    secrets = {
        "the database password": password,
        "the password file's path": str(pg_server.password_file),
        "the store's URL": url,
        "the API key": token,
    }
    with paced_backend(tmp_path, "bk-env", env=server_env, db=url) as rt:
        run_id = submit_testbed(rt, steps=STEPS)
        wait_until(lambda: last_step(rt, run_id) >= 1, TRAINING_TIMEOUT_S, "the run trains")
        actors = {a.pid for a in run_actors(rt, run_id)}
        head = int(ray_cluster.head_pid_file(rt["backend"].var_dir).read_text())
        procs = {pid: p for pid in _tree(head) if (p := _environ(pid)) is not None}

    # The processes read are Ray's: its daemons, and the run's actors (its driver and
    # trainer ranks) among its workers, each environment read for real.
    cmdlines = " | ".join(cmd for cmd, _ in procs.values())
    for daemon in ("gcs_server", "raylet", "dashboard"):
        assert daemon in cmdlines, cmdlines[:2000]
    assert len(actors) >= 2 and actors <= set(procs), (actors, sorted(procs))
    assert all(procs[pid][1].get("RAY_AUTH_MODE") == "token" for pid in actors)
    for pid, (cmd, env) in procs.items():
        for what, value in secrets.items():
            holders = [k for k, v in env.items() if value in v]
            assert not holders, f"{what} in {holders} of pid {pid} ({cmd[:200]})"
        assert not {"PGPASSWORD", "ITO_DB", "ITO_DB_PASSWORD_FILE", "HF_TOKEN"} & set(env), cmd
