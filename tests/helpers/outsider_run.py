"""A real training run on a local Ray of its own whose node address is the outsider
network's host side (``tests/helpers/outsider.py``), for a test to attack from outside.

Run as a script: ``python tests/helpers/outsider_run.py WORKDIR RUN_ID NODE_IP``. With
``ITO_NODE_IP`` and Ray's node IP both ``NODE_IP``, every process of the run takes it
as its cluster address. Written to WORKDIR for the test:

- ``events.jsonl``: the run's events, one JSON object a line, as they come;
- ``ray_ports.json``: this driver's pid and, per pid of the run's Ray actors and the
  driver, the port of Ray's own core-worker server (Ray's, token-authenticated: not a
  listener of the run), refreshed every second;
- ``outcome.json``: the stage's outcome, once the run ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
sys.path.insert(0, str(HELPERS.parent))  # tests/: ``helpers.*``

# Ray's actor table refresh for the test (one GCS read a period).
PORTS_REFRESH_S = 1.0


def _own_listening_ports() -> list[int]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False).stdout
    mine = f"pid={os.getpid()},"
    return sorted({int(li.split()[3].rpartition(":")[2]) for li in out.splitlines() if mine in li})


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _config(workdir: Path) -> object:
    from helpers.tiny_corpus import write_tiny_corpus
    from stages.checkpointing.config import CheckpointPolicy
    from stages.trainer.config import (
        LossSpikeConfig,
        ModelSpec,
        TrainingTarget,
        TrainStageConfig,
    )
    from stages.trainer.fleet.recovery import production_recovery

    data = write_tiny_corpus(workdir / "train.jsonl")
    recovery = production_recovery({"node_count": 1}, standbys_per_node=0)
    fields = recovery.train_fields()
    # The production fronts and listeners, with a 5 s heartbeat timeout instead of 1 s:
    # what the outsider tries (the dashboard's kill, a fake join or heartbeat) does not
    # wait on a timeout, while a group whose heartbeats a loaded CI host delays past 1 s
    # was dropped for a few steps (load average 37), which the test would blame on it.
    fields["fault_tolerance"] = fields["fault_tolerance"].model_copy(
        update={"heartbeat_timeout_ms": 5000}
    )
    return TrainStageConfig.model_validate(
        dict(
            **fields,
            model=ModelSpec(preset="llama-tiny", size="0.1M"),
            # Long enough that the run is still training when the probes are done (the
            # test checks that it was); paced, so a fast host does not outrun them.
            target=TrainingTarget(
                max_steps=int(os.environ.get("ITO_OUTSIDER_STEPS", "300")),
                seq_len=32,
                global_batch_tokens=256,
                warmup_steps=5,
            ),
            checkpoint=CheckpointPolicy(
                interval_steps=50, keep=2, storage_uri=f"file://{workdir}/ckpt"
            ),
            loss_spike=LossSpikeConfig(enabled=False),
            train_files=[str(data)],
            replica_groups=2,
            pace_step_s=0.1,
        ),
        strict=False,
    )


def main(workdir: Path, run_id: str, node_ip: str) -> None:
    os.environ["ITO_NODE_IP"] = node_ip  # inherited by Ray's raylet and every worker
    # The test stops a run it gave up on with SIGTERM: Ray is shut down on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from helpers import ray_local
    from stages.base import StageContext
    from stages.trainer import TrainingStage

    temp = ray_local.start(node_ip=node_ip, namespace="ito-outsider", where="outsider run")
    driver_ports = _own_listening_ports()  # Ray's own, before the run opened any
    lock = threading.Lock()
    events = (workdir / "events.jsonl").open("a", encoding="utf-8")

    def emit(e: object) -> None:
        with lock:
            events.write(e.model_dump_json() + "\n")  # type: ignore[attr-defined]
            events.flush()

    done = threading.Event()

    def ports() -> None:
        from ray._private import state

        while not done.wait(PORTS_REFRESH_S):
            table = {os.getpid(): driver_ports}
            for a in state.actors().values():
                if a.get("State") == "ALIVE" and a.get("Pid"):
                    table[int(a["Pid"])] = [int(a["Address"]["Port"])]
            _write_json(workdir / "ray_ports.json", {"driver": os.getpid(), "ray_ports": table})

    threading.Thread(target=ports, daemon=True).start()
    ctx = StageContext(run_id=run_id, booking_id="bk", workdir=workdir, emit=emit)
    try:
        outcome = TrainingStage(_config(workdir)).run(ctx)  # type: ignore[arg-type]
        _write_json(workdir / "outcome.json", outcome.model_dump(mode="json"))
    finally:
        done.set()
        ray_local.stop(temp)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
