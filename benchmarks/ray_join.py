"""Where a Ray benchmark runs: a local Ray of its own (run by hand), or an existing
cluster named by ``--ray-address``. The CI smokes join the test session's Ray: a Ray
start-up and shutdown cost each smoke 10-40 s on the loaded 2-core testbed. Ray puts
the benchmark's folder and working directory on its job's workers' import path; the
cluster's nodes must carry the launch key file the benchmark uses
(``ITO_LAUNCH_KEY_FILE``: ranks seal checkpoints with its key) and the logical CPUs
it asks for. elastic.py's Ray Train half always starts a multi-node cluster of its
own."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_ray_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (host:port; its own logical CPUs) instead of "
        "starting a local one",
    )


def init_ray(address: str | None, temp_dir: Path, num_cpus: int, **local: Any) -> None:
    """``ray.init`` this process: into the cluster at ``address``, else a local Ray with
    ``num_cpus`` logical CPUs, its files under ``temp_dir`` and ``local``'s options."""
    import ray

    if address:
        ray.init(address=address, log_to_driver=False)
        return
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        log_to_driver=False,
        **local,
    )
