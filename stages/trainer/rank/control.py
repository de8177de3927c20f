"""What a rank is told: its spec at start-up, and the driver's commands at step
boundaries (pause, resume, restore, the next phase, stop)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict, Unpack

from stages.run_facts import PlacementFact
from stages.trainer.config import TrainStageConfig

CommandKind = Literal["resume", "restore", "next_phase", "members"]
# What the driver sends a rank (``ReplicaWorker.command``): the loop's commands, and
# what the rank applies at once (stop, drain, pause, hold, go, activate, data).
CommandName = Literal[CommandKind, "stop", "drain", "pause", "hold", "go", "activate", "data"]
# Token shards by data role; each phase's mix reads the roles it names.
RoleShards = dict[str, list[str]]


@dataclass
class WorkerSpec:
    """Everything one rank needs; picklable, passed to the Ray actor."""

    run_id: str
    replica_group: int
    rank: int
    config: TrainStageConfig
    # "": the run's lighthouse was still starting when the rank was made; the rank asks
    # it by its name (``lighthouse.lighthouse_address``) when it joins.
    lighthouse_addr: str
    checkpoint_dir: str
    # Rank 0 of a multi-rank group hosts the group's TCPStore; others get it here.
    store_addr: str = "127.0.0.1"
    store_port: int = 0
    # A standby's group of standbys (``replica_group`` is -1 until it is activated):
    # its ranks form one group, around the store its rank 0 hosts.
    standby_index: int | None = None
    # A fleet handed from one engine run to the next keeps its actors, named after the
    # run that made them (``fleet_id``; "" is ``run_id``); each rank's current spec is
    # kept in ``assignment_path``, which a process Ray restarts reads instead of the
    # spec it was made with ("" for a fleet that is not handed on).
    fleet_id: str = ""
    assignment_path: str = ""
    # The run's account: its checkpoints are sealed for it and the run.
    account: str = ""
    # The run's placement (``stages.placement``'s fact, JSON): the fronts of the
    # group's listeners admit its nodes only (None: every Ray node).
    placement: PlacementFact | None = None
    # A group a resize adds to the running run: after the driver's "go" it joins the
    # quorum and heals from a live peer; it never reads a checkpoint.
    joining: bool = False
    # A group that resumes a run paused for capacity: after reading the checkpoint it
    # shares the batch with these groups from this step on ([step, [groups]]).
    membership_from: tuple[int, tuple[int, ...]] | None = None

    @property
    def names_id(self) -> str:
        """The run id the fleet's actor names carry."""
        return self.fleet_id or self.run_id


class CommandParams(TypedDict, total=False):
    """A command's parameters, as the driver sends them (through Ray): each command
    names its own."""

    # restore: the checkpoint's step, and the data batches to skip from there.
    step: int
    skip_batches: int
    # members: the first step the batch is shared by ``members`` (replica groups).
    first_step: int
    members: Sequence[int]
    # activate: the group a standby becomes, and on cuda the device it takes over;
    # ``joining``: a group a resize adds (it heals from the live groups it joins and
    # never reads a checkpoint), not a lost group's stand-in.
    group: int
    gpu_ids: Sequence[int | str]
    joining: bool
    # data: the run's token shards by data role.
    role_shards: Mapping[str, Sequence[str]]


@dataclass
class Control:
    """Commands from the driver to the loop, applied at step boundaries."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: bool = False
    # The run pauses for capacity: the saving group checkpoints before it stops.
    save_at_stop: bool = False
    # Fresh workers wait for "go" so that every group joins the first quorum together.
    go: threading.Event = field(default_factory=threading.Event)
    # The driver asks every group to pause at its next step boundary (a spike elsewhere).
    pause: bool = False
    # The driver asks every group to stop at one step's end, all at the same one (a
    # resize): this rank votes so in each step's reduction until it is held.
    hold: bool = False
    command: tuple[CommandKind, CommandParams] | None = None
    # A spare is told which replica group to become, and whether a resize adds it.
    activate_group: int | None = None
    activate_joining: bool = False
    # The run's token shards: a rank is started (model built, group joined) before
    # the run's data exists, and waits for them before its first phase.
    role_shards: RoleShards | None = None

    def send(self, kind: CommandName, **params: Unpack[CommandParams]) -> None:
        with self.cond:
            if kind == "stop" or kind == "drain":  # (not `in`: mypy narrows this)
                self.stop = True
                self.save_at_stop = kind == "drain"
                self.go.set()
            elif kind == "go":
                self.go.set()
            elif kind == "activate":
                self.activate_group = int(params["group"])
                self.activate_joining = bool(params.get("joining", False))
            elif kind == "data":
                shards = params["role_shards"]
                self.role_shards = {str(r): [str(p) for p in ps] for r, ps in shards.items()}
            elif kind == "pause":
                self.pause = True
            elif kind == "hold":
                self.hold = True
            else:
                self.command = (kind, params)
            self.cond.notify_all()

    def wait_activation(self) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: self.stop or self.activate_group is not None)
            return None if self.stop else self.activate_group

    def wait_data(self) -> RoleShards | None:
        with self.cond:
            self.cond.wait_for(lambda: self.stop or self.role_shards is not None)
            return None if self.stop else self.role_shards

    def wait_command(self) -> tuple[str, CommandParams]:
        with self.cond:
            self.cond.wait_for(lambda: self.stop or self.command is not None)
            if self.stop:
                return "stop", {}
            assert self.command is not None
            cmd, self.command = self.command, None
            self.pause = False
            return cmd
