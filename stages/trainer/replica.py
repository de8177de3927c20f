"""Ray actors of a run: the torchft lighthouse and one trainer actor per rank.

Both are plain classes wrapped with ``ray.remote`` by the engine, so importing this
module never imports Ray. A trainer actor starts its loop in ``__init__``: when Ray
restarts it after a crash (``max_restarts``), the new process rejoins on its own —
it loads the newest complete checkpoint, and torchft heals it from a live peer if
one is ahead. The driver only pulls events (``poll``) and relays commands.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from typing import Any

from stages.event_buffer import EventBuffer
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.loop import Control, TrainLoop, WorkerSpec, param_digest

# Events buffered in an actor between two polls; beyond this they are aggregated.
MAX_BUFFERED_EVENTS = 10_000


def lighthouse_name(run_id: str) -> str:
    return f"run-{run_id}-lighthouse"


def worker_name(run_id: str, group: int, rank: int) -> str:
    return f"run-{run_id}-trainer-rg{group}-rank{rank}"


def spare_name(run_id: str, index: int) -> str:
    return f"run-{run_id}-trainer-spare{index}-rank0"


def trainer_prefix(run_id: str) -> str:
    return f"run-{run_id}-trainer-"


class LighthouseActor:
    """torchft's Rust LighthouseServer, kept alive for the run by this actor."""

    def __init__(self, cfg: FaultToleranceConfig, min_replicas: int = 1):
        os.environ.setdefault("RUST_LOG", "warn")
        from stages.trainer import ft

        self.server = ft.start_lighthouse(cfg, min_replicas=min_replicas)

    def address(self) -> str:
        return str(self.server.address())

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.server.shutdown()


class ReplicaWorker:
    """One rank of one replica group: the training loop in a thread, events buffered."""

    def __init__(self, spec: WorkerSpec):
        import ray
        import torch

        # Threads follow the actor's CPU share (env vars would need a runtime_env,
        # which rules out Ray's prestarted workers on restart).
        torch.set_num_threads(max(1, round(spec.config.worker_num_cpus)))
        self.spec = spec
        self._lock = threading.Lock()
        self._events = EventBuffer(MAX_BUFFERED_EVENTS)
        self.control = Control()
        with warnings.catch_warnings():  # Ray marks the property deprecated, no successor
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.status: dict[str, Any] = {
            "pid": os.getpid(), "phase": "starting", "step": 0, "restarted": restarted,
            "started_at": time.time(), "error": None, "paused_at": None, "spike": None,
        }
        self.store: Any = None
        if spec.config.ranks_per_group > 1:
            self._group_store(spec)
        self.loop = TrainLoop(spec, emit=self._emit, control=self.control, status=self.status)
        self._thread = threading.Thread(target=self._main, name="train-loop", daemon=True)
        self._thread.start()

    def _group_store(self, spec: WorkerSpec) -> None:
        """Multi-rank group: rank 0 hosts the group's TCPStore (it dies with rank 0, so
        every incarnation of the group gets a fresh one); the other ranks ask rank 0.
        If rank 0 is restarting, Ray holds the call until it is back."""
        import ray
        from torch.distributed import TCPStore

        if spec.rank == 0:
            spec.store_addr = ray.util.get_node_ip_address()
            self.store = TCPStore(spec.store_addr, 0, is_master=True, wait_for_workers=False)
            spec.store_port = self.store.port
            return
        rank0 = ray.get_actor(worker_name(spec.run_id, spec.replica_group, 0))
        ref: Any = rank0.store_address.remote()
        addr, port = ray.get(ref, timeout=spec.config.fault_tolerance.actor_ready_timeout_s)
        spec.store_addr, spec.store_port = str(addr), int(port)

    def store_address(self) -> tuple[str, int]:
        return self.spec.store_addr, self.spec.store_port

    def _emit(self, event: Any) -> None:
        with self._lock:
            self._events.append(event.model_dump(mode="json"))

    def _main(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # reported to the driver, which fails the run
            self.status.update(phase="error", error=f"{type(e).__name__}: {e}",
                               traceback=traceback.format_exc()[-4000:])

    # --- driver API -----------------------------------------------------------------
    def poll(self) -> dict[str, Any]:
        """Drain buffered events and report status (the driver pulls; never pushes)."""
        with self._lock:
            events = self._events.drain()
        return {"events": events, "status": dict(self.status)}

    def pid(self) -> int:
        return os.getpid()

    def identity(self) -> dict[str, int]:
        """Which group and rank this process is now (a spare changes group once)."""
        return {"group": self.loop.spec.replica_group, "rank": self.spec.rank,
                "pid": os.getpid()}

    def command(self, kind: str, params: dict[str, Any] | None = None) -> None:
        self.control.send(kind, **(params or {}))  # type: ignore[arg-type]

    def evaluate_phase(self, request: dict[str, Any]) -> dict[str, Any]:
        """The phase's battery and HF export on this rank, while its loop waits at the
        phase's end (stages.trainer.phase_eval)."""
        from stages.errors import ErrorCode, ItoError
        from stages.trainer.phase_eval import PhaseEvalRequest, evaluate_on_rank

        req = PhaseEvalRequest.model_validate(request)
        if self.status.get("boundary") != req.phase.index:
            raise ItoError(ErrorCode.invalid_state,
                           f"rank is not waiting at the end of phase {req.phase.name}")
        loop = self.loop
        live = None if loop.sharded or loop.cfg.layout.activation_checkpointing != "none" \
            or loop.parallel.fp8_linears else loop.model
        return evaluate_on_rank(req, cfg=loop.cfg, live=live).model_dump(mode="json")

    def param_digest(self) -> dict[str, Any]:
        """sha256 over every parameter's bytes, with the step it was taken at."""
        return {"digest": param_digest(self.loop.model), "step": self.loop.manager.current_step()}
