"""A trainer fleet handed from one engine run to the next.

A run's engine runs (pretraining's phases, then each post-training objective: SFT,
DPO, RLVR's learner) follow one another on the same replica groups. Starting each
one's fleet anew spawns every rank's process, imports torch, torchft and
transformers, and (on GPUs) initialises CUDA and binds the device again. A ``Fleet``
(the run driver's, ``StageContext.fleet``) keeps the ranks' actors between the runs
instead, with their torchft lighthouse: the next engine tells each rank its new spec
(``ReplicaWorker.reassign``); the rank builds the next run's loop (model from the
previous run's export, optimizer, Manager, checkpoints) in the same process.

Ray restarts a crashed actor with the arguments it was made with, which name the
first run. Each rank's current spec is therefore also kept in a file of its own
(``assignment_path``), written before the rank is told: a restarted process reads it
(``current_spec``) and rejoins the run it belonged to when it died.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.atomic_write import write_bytes
from stages.run_secret import RunSecret
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.rank.control import WorkerSpec

if TYPE_CHECKING:
    from pydantic import TypeAdapter

Shape = tuple[int, int, str]  # replica groups, ranks per group, device


def _adapter() -> TypeAdapter[WorkerSpec]:
    from pydantic import TypeAdapter

    return TypeAdapter(WorkerSpec)


def write_assignment(spec: WorkerSpec) -> None:
    """Keep ``spec`` as its rank's current one (atomically: a restart never reads half)."""
    path = Path(spec.assignment_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not durable: a restarted process reads it; a host that crashes takes its actors.
    write_bytes(path, _adapter().dump_json(spec), durable=False)


def current_spec(spec: WorkerSpec) -> WorkerSpec:
    """The spec a rank's process runs: the newest assignment when it has one (a process
    Ray restarted after its fleet was handed on), else the one it was made with."""
    if not spec.assignment_path or not os.path.exists(spec.assignment_path):
        return spec
    kept: WorkerSpec = _adapter().validate_json(Path(spec.assignment_path).read_bytes())
    return kept


def _set_event() -> threading.Event:
    done = threading.Event()
    done.set()  # no placement under way
    return done


@dataclass
class Fleet:
    """The ranks one engine run leaves to the next (``TrainingEngine(fleet=...)``).

    Empty until a run made its actors; a run whose shape differs (replica groups,
    ranks per group, device) replaces them. A multi-rank group's in-group process
    group is each process's default one, made once: it goes on with the ranks, and
    only torchft's store is made anew for each run. The lighthouse goes on with the
    ranks; a run whose fault-tolerance settings differ starts its own. Whoever made
    the ``Fleet`` ends it (``shutdown``) after the last run; a run that fails kills
    its ranks and lighthouse itself."""

    folder: Path  # each rank's current spec, one file per actor (private to the run)
    fleet_id: str = ""  # the run id the actors' names carry
    shape: Shape | None = None
    actors: dict[tuple[int, int], Any] = field(default_factory=dict)
    # The run secret the actors were made with (Ray restarts them with it): every
    # engine run on them uses it.
    secret: RunSecret | None = field(default=None, repr=False)
    # The torchft lighthouse the ranks' last run used, and its settings (the next run
    # keeps it when its own are the same).
    lighthouse: Any = None
    lighthouse_settings: FaultToleranceConfig | None = None
    # The ranks of the engine run placed last, for work that borrows their devices
    # before that run trains (the ladder probe's proxies, while the fleet warms up).
    placed: dict[tuple[int, int], Any] = field(default_factory=dict)
    _placement_done: threading.Event = field(default_factory=_set_event, repr=False)

    def placing(self) -> None:
        """An engine run starts placing its ranks: ``placed_ranks`` waits for them."""
        self.placed = {}
        self._placement_done.clear()

    def place_done(self, actors: dict[tuple[int, int], Any]) -> None:
        """The run's ranks are made or taken over (none when its placement failed)."""
        self.placed = dict(actors)
        self._placement_done.set()

    def placed_ranks(self, timeout_s: float) -> dict[tuple[int, int], Any]:
        """The last placed run's ranks, waiting at most ``timeout_s`` while a placement
        is under way; empty when none was placed (or it failed, or timed out)."""
        self._placement_done.wait(timeout_s)
        return dict(self.placed)

    def assignment_path(self, actor_name: str) -> str:
        return str(self.folder / f"{actor_name}.json")

    def kill_ranks(self) -> None:
        kill_actors(*self.actors.values())
        self.actors.clear()
        self.placed = {}

    def shutdown(self) -> None:
        self.kill_ranks()
        kill_actors(self.lighthouse)
        self.lighthouse = None


def kill_actors(*actors: Any) -> None:
    """Kill each actor for good (no restart); None and actors already gone are skipped."""
    import ray

    for actor in actors:
        if actor is not None:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
