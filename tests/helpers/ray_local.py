"""The one in-process local Ray of a test session (the ``ray_local`` fixture of
tests/conftest.py): every test that drives Ray from this process shares it, since a
cluster start-up costs ~25 s on the 2-core testbed. A test that needs Ray *down* in
its process runs its check in a subprocess of its own.

Each Ray cluster a test starts (this one, a server's embedded head, a multi-raylet
cluster) is noted by :func:`note_start`: with ``ITO_TEST_RAY_LOG=PATH`` one line is
appended to PATH per start-up, so a CI run can count them."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

RAY_LOG_ENV = "ITO_TEST_RAY_LOG"
# Logical CPUs: the trainer tests schedule up to 4 single-CPU workers; Ray does not
# pin them, so this is admission, not cores.
NUM_CPUS = 4
# Small on purpose: the streaming test spills to disk through it.
OBJECT_STORE_BYTES = 200 * 2**20
NAMESPACE = "ito-tests"
START_ATTEMPTS = 3


# Ray gives a starting raylet a fixed 30 s to register with its GCS, which two
# clusters starting at once on a loaded 2-core host can both miss: the tests' Ray
# start-ups (on any pytest-xdist worker) take turns. Only the start-up: the clusters
# then run side by side.
START_LOCK = os.path.join(tempfile.gettempdir(), "ito-tests-ray-start.lock")


@contextmanager
def start_turn() -> Iterator[None]:
    """Hold the host-wide turn for starting a Ray cluster (or a server that starts one)."""
    with open(START_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def note_start(kind: str, where: str) -> None:
    """Record one Ray cluster start-up (``kind``: local, embedded-head, cluster)."""
    path = os.environ.get(RAY_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {kind} {where}\n")


def start(
    *, node_ip: str | None = None, namespace: str = NAMESPACE, where: str = "tests session"
) -> str:
    """``ray.init`` a local cluster for this process; returns its temp folder.
    ``node_ip``: the address Ray registers the node with (the outsider test's veth end)."""
    import ray

    from stages.data_prep.stream.output import spilling_config

    for attempt in range(1, START_ATTEMPTS + 1):
        temp = tempfile.mkdtemp(prefix="ray-t-")  # short: Ray's socket paths < 107 bytes
        try:
            with start_turn():
                ray.init(
                    address="local",
                    num_cpus=NUM_CPUS,
                    include_dashboard=False,
                    _temp_dir=temp,
                    _node_ip_address=node_ip,
                    log_to_driver=False,
                    namespace=namespace,
                    object_store_memory=OBJECT_STORE_BYTES,
                    _system_config={"object_spilling_config": spilling_config(temp + "/spill")},
                )
        except Exception:
            # Ray gives a new raylet a fixed 30 s to register with its GCS, which an
            # overloaded host can miss; the next attempt usually makes it.
            stop(temp)
            if attempt == START_ATTEMPTS:
                raise
            continue
        note_start("local", f"{where}, attempt {attempt}")
        return temp
    raise AssertionError("unreachable")


def stop(temp: str) -> None:
    import ray

    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
