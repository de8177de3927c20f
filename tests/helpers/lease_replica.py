"""One supervisor replica as a process: the real ``RayRuntime`` loop (lease, fence,
forget-on-takeover) with a fake launcher instead of Ray.

Ray and the drivers are what is faked, and only they: ``_connect`` joins no cluster
and ``_tick`` "launches" a run by writing a ``launched`` log event and "watches" a
running one by writing a ``watch`` event, both through the supervisor's fenced store,
exactly where the real tick writes. Each watch first waits ``--tick-s`` (a slow
driver RPC) and bumps a count in ``<var-dir>/mid-tick``, so a test can SIGSTOP it
between a tick's read and its write. ``<var-dir>/ready`` appears once it runs.

    python -m helpers.lease_replica --db URL --lease-s 3 --poll-s 0.2 --tick-s 0.5
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path

from orchestrator.db.store import Row, Store
from orchestrator.runs import RunState
from orchestrator.runtime.ray_cluster import RaySettings
from orchestrator.runtime.supervisor import RayRuntime
from orchestrator.runtime.supervisor_settings import SupervisorSettings
from stages.events import LogEvent


class FakeLauncherRuntime(RayRuntime):
    tick_s = 0.0
    ticks = 0
    mark: Path | None = None

    def _connect(self) -> None:
        return None

    def _event(self, run_id: str, message: str) -> None:
        seq = self.store.max_seq(run_id) + 1
        ev = LogEvent(stage="orchestrator", message=f"{message} token={self.fence.token}")
        self.store.ingest_events(run_id, [{**ev.model_dump(mode="json"), "seq": seq}])

    def _tick(self, run: Row) -> None:
        run_id, state = run["run_id"], RunState(run["state"])
        if state == RunState.accepted:
            self.store.transition(run_id, RunState.starting, "fake launcher")
            self._event(run_id, "launched")
            self.store.transition(run_id, RunState.running, "fake driver running")
        elif state == RunState.running:
            self.ticks += 1
            if self.mark is not None:  # the test pauses the process here, mid-tick
                self.mark.write_text(str(self.ticks))
            time.sleep(self.tick_s)
            self._event(run_id, "watch")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--var-dir", required=True)
    ap.add_argument("--lease-s", type=float, required=True)
    ap.add_argument("--poll-s", type=float, required=True)
    ap.add_argument("--tick-s", type=float, default=0.0)
    args = ap.parse_args()
    store = Store(args.db)
    rt = FakeLauncherRuntime(
        store,
        Path(args.var_dir),
        RaySettings(),
        SupervisorSettings(supervisor_lease_s=args.lease_s, poll_interval_s=args.poll_s),
    )
    rt.tick_s = args.tick_s
    var = Path(args.var_dir)
    var.mkdir(parents=True, exist_ok=True)
    rt.mark = var / "mid-tick"
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    rt.start()
    (var / "ready").write_text(rt.fence.holder)
    done.wait()
    rt.stop()
    store.close()


if __name__ == "__main__":
    main()
