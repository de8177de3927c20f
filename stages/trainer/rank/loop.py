"""The training loop of one rank of one replica group (torchtitan style, torchft inside).

``run`` is the recipe: build the model, join the replica group (torchft Manager,
checkpoints, resume), then ``train_step`` and ``_after_commit`` until the schedule's last
step; where it stops after a step for the driver (a loss spike's pause, a resize's
hold) is ``rank/stops.py``. The loop follows the curriculum's schedule of phases in
place: at a phase's end step it saves and keeps the closing checkpoint, waits for the
driver's gate, then changes sequence length, data mix, LR schedule and RoPE base and
goes on; the model, optimizer, process groups and Manager stay. A run without a
curriculum is a one-phase schedule: there is one loader (``MixedLoader``) and one LR
source (``PhaseSpan.lr``). Every torchft touch point is tagged ``# torchft:``.

Data is indexed by step, not by "what the loader happened to serve": the batch of
step ``s`` is ``objective.batch(data_index(s - phase.start_step, skipped_windows))``.
Retrying an uncommitted step, healing from a peer, restoring a checkpoint and skipping
a poisoned window are then all the same operation (ask for that index). The objective
(``stages.trainer.rank.objective``: lm, sft, dpo or grpo) gives the batches and the loss; the
loop, the layout and torchft are the same for all of them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from stages.curriculum.schedule import PhaseSpan
from stages.events import Event, FleetEvent, LogEvent, PhaseEvent
from stages.run_secret import RunSecret
from stages.trainer.rank.control import Control, WorkerSpec
from stages.trainer.rank.group_sync import GroupSync
from stages.trainer.rank.membership import Membership
from stages.trainer.rank.objective import Batch, LanguageModelObjective, Objective
from stages.trainer.rank.rank_state import RankState, RankStatus
from stages.trainer.rank.saving import RankSaver
from stages.trainer.rank.shard_state import load_sharded_state, param_digest, sharded_state
from stages.trainer.rank.step_state import LoopState, StepResult, Window, data_index
from stages.trainer.rank.stops import hold, pause, spiked

if TYPE_CHECKING:
    from stages.checkpointing.checkpointer import Checkpointer
    from stages.trainer.parallel.parallelize import ParallelModel
    from stages.trainer.rank.loss_spike import LossSpikeDetector
    from stages.trainer.rank.mix import MixedLoader
    from stages.trainer.rank.train_state import TrainState

__all__ = ["Control", "StepResult", "TrainLoop", "WorkerSpec", "data_index", "param_digest"]

# A wait for a batch's data this long is reported as an idle span of its own (shorter
# ones are left out of the step's time all the same).
IDLE_SPAN_MIN_S = 0.05


class RankStartup(Protocol):
    """What the loop asks of its rank's start-up (``stages.trainer.rank.setup.RankSetup``,
    which the actor hands in: the start-up fills the loop in, so the loop names only
    these steps of it)."""

    device: torch.device

    def prepare_standby(self) -> None: ...
    def wait_as_spare(self) -> bool: ...
    def build(self) -> None: ...
    def join(self) -> bool: ...
    def warm_up(self) -> None: ...
    def close(self) -> None: ...


class TrainLoop:
    def __init__(
        self,
        spec: WorkerSpec,
        *,
        emit: Callable[[Event], None],
        control: Control,
        status: RankStatus,
        secret: RunSecret,
        startup: Callable[[TrainLoop], RankStartup],
    ):
        self.spec = spec
        # The run's secret (from the driver, through Ray): this rank's heals prove it.
        self.secret = secret
        self.cfg = spec.config
        self.schedule = spec.config.schedule
        self.emit_fn = emit
        self.control = control
        self.status = status  # shared with the actor: read by the driver's polls
        self.is_reporter = spec.rank == 0  # each group's rank 0 reports events
        self.windows: list[Window] = []
        # The groups sharing each step's global batch: changed by a resize only.
        self.membership = Membership.initial(spec.config.replica_groups)
        # When the first step of each membership began waiting for a missing member.
        self._member_wait: dict[int, float] = {}
        # The run's token shards by data role, from the driver once its data is ready.
        self.role_shards: dict[str, list[str]] = {}
        self.started_at = time.time()
        self.phase: PhaseSpan = self.schedule.phases[0]
        self.healed = False
        self._rope_theta: float | None = None  # None: the preset's
        self.recovering_since: float | None = None
        self.setup = startup(self)
        # Set by the setup (model, optimizer) and by join (Manager, loader, checkpoints).
        self.model: torch.nn.Module
        self.parallel: ParallelModel
        self.inner_optimizer: torch.optim.Optimizer
        self.manager: Any
        # torchft: the replica groups' sync, made by the setup with the Manager: the
        # gradient allreduce of every step, or DiLoCo's every ``sync.sync_every`` steps.
        self.sync: GroupSync
        # The steps of the other live groups' rank 0 (the actor asks Ray; a DiLoCo group
        # joining a running run waits for their next sync).
        self.peer_steps: Callable[[], list[int]] = list
        self.loader: MixedLoader | None = None  # the lm objective's MixedLoader (None for sft/dpo)
        self.objective: Objective
        self.ckpt: Checkpointer | None = None
        self.saver: RankSaver  # when this group saves, and the saves' reports
        self.detector: LossSpikeDetector
        self.train_state: TrainState
        self.loop_state = LoopState(self)
        self.sharded = spec.config.ranks_per_group > 1
        # The imports of what a phase end runs, on a thread while the rank waits for
        # data and trains (``phase_eval.warm_phase_end``); a phase end's work joins it
        # first (transformers' lazy imports are not thread-safe).
        self.phase_end_imports: threading.Thread | None = None
        # Whether join restores the newest checkpoint (the actor decides: replica.py; a
        # live peer ahead of every checkpoint heals the group through torchft instead).
        self.checkpoint_needed: Callable[[], bool] = lambda: True

    @property
    def checkpointer(self) -> Checkpointer:
        """The group's checkpointer: join makes it (before join a heal finds none)."""
        assert self.ckpt is not None, "the checkpointer is made by join"
        return self.ckpt

    # --- events ---------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        if self.is_reporter:
            event.stage = "train"
            self.emit_fn(event)

    def log(
        self, message: str, level: Literal["debug", "info", "warning", "error"] = "info"
    ) -> None:
        self.emit(LogEvent(message=f"rg{self.spec.replica_group}: {message}", level=level))

    def restored(self, step: int, skipped: tuple[int, int] | None = None) -> None:
        """This group loaded checkpoint ``step`` (and skips the data batches ``skipped``)."""
        self.emit(
            FleetEvent(
                action="checkpoint_restored",
                replica_group=self.spec.replica_group,
                step=step,
                skipped_batches=skipped,
            )
        )
        if skipped is None:
            self.log(f"resumed from checkpoint step {step}")
        else:
            self.log(
                f"restored checkpoint step {step}, skipping data batches [{skipped[0]}, "
                f"{skipped[1]})"
            )

    # --- state (torchft: what a healing peer fetches and loads) ---------------------
    def heal_state(self) -> dict[str, Any]:
        """With FSDP2 each rank sends its local shards: rank r of the peer holds rank
        r's shards."""
        if self.sharded:
            return {
                "shards": sharded_state(self.model, self.inner_optimizer),
                "loop": self.loop_state.state_dict(),
            }
        return {
            "model": self.model.state_dict(),
            "optim": self.inner_optimizer.state_dict(),
            "loop": self.loop_state.state_dict(),
        }

    def load_heal_state(self, state: dict[str, Any]) -> None:
        # A heal overwrites the weights in place; an async save still copying them
        # must finish first (the optimizer-step guard does not see this write).
        if self.ckpt is not None:
            self.ckpt.wait_staged()
        if "shards" in state:
            load_sharded_state(self.model, self.inner_optimizer, state["shards"])
        else:
            self.model.load_state_dict(state["model"])
            self.inner_optimizer.load_state_dict(state["optim"])
        self.loop_state.load_state_dict(state["loop"])
        self.healed = True
        if self.cfg.sync.every_step:
            # torchft: the heal loads inside should_commit, before this group's vote, and
            # the group commits its peers' step: it votes on that step's members as they
            # do, not on its own stale step and members (committing the first step of a
            # resize's members that its peer refused would leave that batch untrained).
            self.refuse_if_members_missing(self.current_step())

    # --- phases ---------------------------------------------------------------------
    def enter_phase(self, phase: PhaseSpan) -> None:
        """Train ``phase`` from here on: its sequence length, data mix (a fresh
        ``MixedLoader`` behind the lm objective), LR schedule and RoPE base. Model,
        optimizer and a post-training objective (one phase) stay."""
        from stages.trainer.rank.mix import MixedLoader

        self.phase = phase
        self.set_rope_base(phase)
        self.status.update(phase_name=phase.name)
        if self.cfg.objective.kind != "lm":
            return
        self.loader = MixedLoader(
            {r: [Path(p) for p in ps] for r, ps in self.role_shards.items()},
            dict(phase.data_weights),
            seq_len=phase.seq_len,
            micro_batch=self.cfg.micro_batch_at(phase.seq_len),
            seed=self.cfg.target.seed + phase.index,
            dp_rank=self.dp_rank,
            dp_world=self.cfg.dp_world,
            phase=phase.name,
        )
        self.objective = LanguageModelObjective(self.loader)
        if getattr(self, "train_state", None) is not None:
            self.train_state.loader = self.loader

    def set_rope_base(self, phase: PhaseSpan) -> None:
        """The phase's RoPE base. None keeps the base in use (a scheduled curriculum names
        one for every phase when the preset has one)."""
        from stages.model.lm import set_rope_theta

        if phase.rope_theta is not None and phase.rope_theta != self._rope_theta:
            set_rope_theta(self.model, phase.rope_theta)
            self._rope_theta = phase.rope_theta

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index over the run as planned; ranks of a group that
        differ only in pp, cp or tp read the same batch."""
        layout = self.cfg.layout
        return self.spec.replica_group * layout.dp_shard + layout.coords(self.spec.rank)["dp_shard"]

    def cut(self, step: int) -> tuple[int, int] | None:
        """Point the loader at this rank's share of step ``step``'s batch; returns the
        group's place among the step's member groups and their count. A group that is
        no member (one joining, healing at the step before its first) reads the first
        share and has none of its own (None): its peers' state replaces what it trains."""
        share = self.membership.share(self.spec.replica_group, step)
        if self.loader is not None:
            place, members = share or (0, len(self.membership.members_at(step)))
            layout = self.cfg.layout
            shard = layout.coords(self.spec.rank)["dp_shard"]
            self.loader.cut(place * layout.dp_shard + shard, members * layout.dp_shard)
        return share

    def share_tokens(self, step: int, read: int) -> int:
        """The tokens of one data-parallel rank's share of step ``step``'s batch, cut over
        that step's members (a group that healed into the step read its own, stale,
        cut); ``read``: what this rank read, the answer where the cut never changes."""
        if self.loader is None:
            return read
        width = len(self.membership.members_at(step)) * self.cfg.layout.dp_shard
        return self.loader.global_batch // width * self.loader.seq_len

    def members_missing(self, step: int) -> bool:
        """Whether step ``step`` is the first of its members (a resize, a resume, the
        start) and one of them is not in its quorum yet, for at most ``member_wait_s``:
        the step is then tried again rather than trained without the member's share."""
        first = self.membership.changes[-1][0]
        members = len(self.membership.members_at(step))
        if step != first or self.manager.num_participants() >= members:  # torchft
            return False
        if first not in self._member_wait:
            self._member_wait[first] = time.monotonic()
            self.log(f"step {step}: waiting for all {members} member groups in the quorum")
        return time.monotonic() - self._member_wait[first] < self.cfg.fault_tolerance.member_wait_s

    def refuse_if_members_missing(self, step: int) -> None:
        """Refuse step ``step`` everywhere while a member group is missing from its
        quorum (``members_missing``): every group of the quorum votes so on that step."""
        if self.members_missing(step):
            self.manager.report_error(RuntimeError(f"step {step}: a member group is missing"))

    def _close_phase(self, step: int) -> bool:
        """At ``phase.end_step``: save the closing checkpoint (complete before the
        driver looks), report the boundary, wait for the gate. False: stop."""
        self.saver.save(step, force=True)
        self.checkpointer.wait()
        self.saver.report()
        # The driver may now evaluate this rank's model (ReplicaWorker.evaluate_phase).
        self.status.enter(RankState.phase_end, boundary=self.schedule.phase_of(step - 1).index)
        kind, _ = self.control.wait_command()
        self.status.enter(RankState.training, boundary=None)
        if kind != "next_phase":
            return False
        if step < self.schedule.total_steps:
            self.windows = []  # skipped windows index the previous phase's data
            self.enter_phase(self.schedule.phase_of(step))
        return True

    # --- the loop -------------------------------------------------------------------
    def run(self) -> None:
        restarted = self.status.report().restarted
        if self.spec.replica_group < 0:
            self.setup.prepare_standby()
            if not self.setup.wait_as_spare():
                return
            restarted = True  # joins a running job: heal, no start barrier
        else:
            self.setup.build()
        if not self.setup.join():
            return self._finish()  # stopped before the run's data was ready
        if self.spec.joining:
            # A group a resize adds pays its one-off costs while the run still trains,
            # not in the first steps every group then waits for.
            self.setup.warm_up()
        self.status.enter(RankState.ready)
        if not restarted:
            self.control.go.wait()
        self.emit(PhaseEvent(phase="startup", start=self.started_at, end=time.time()))
        self.status.enter(RankState.training)
        # Recovery is from a failure: a standby a grow promotes (activated ``joining``)
        # joins as a launched joiner does, its time the resize's (goodput), not a fault's.
        recovering = restarted and not self.control.activate_joining
        self.recovering_since = self.started_at if recovering else None
        if restarted:
            # A group joining a running run (DiLoCo: it heals at its peers' next sync).
            self.sync.join_running_run(self.peer_steps, lambda: self.control.stop)
            self.after_heal(self.current_step() - 1)
        step = self.current_step()
        # A group resumed from a phase-closing checkpoint waits for that phase's gate.
        if (
            step > 0
            and step == self.schedule.phase_of(step - 1).end_step
            and not self._close_phase(step)
        ):
            return self._finish()
        while not self.control.stop:
            step = self.current_step()
            if step >= self.schedule.total_steps:
                break
            if self.control.pause:
                pause(self, step)
                continue
            self._after_commit(self.train_step(step))
        self._finish()

    def next_batch(self, batch: int) -> Batch:
        """Data batch ``batch`` on the device (a wait for data not made yet is an idle
        span of its own)."""
        data = self.objective.batch(batch).to(self.device)
        if data.waited_s >= IDLE_SPAN_MIN_S:  # the batch's data did not exist yet
            got_at = time.time()
            self.emit(PhaseEvent(phase="idle", start=got_at - data.waited_s, end=got_at))
        return data

    def current_step(self) -> int:
        """The run's step: torchft's, or with DiLoCo its syncs' steps and the inner
        steps since."""
        return self.sync.current_step()

    def after_heal(self, trained: int) -> bool:
        """Whether this group loaded a peer's state (torchft's heal) since the last
        look; it then follows the peers' phase at their step ``trained``."""
        if not self.healed:
            return False
        self.healed = False
        self.log(f"healed from a live peer at step {trained}")
        if not self.phase.start_step <= trained < self.phase.end_step:
            self.enter_phase(self.schedule.phase_of(trained))
        return True

    def pace(self, t0: float, quorum: int, step: int) -> None:
        """Test and benchmark pacing (``pace_step_s``; ``degraded_pace_step_s`` while
        a member group is missing from the quorum): 0 in real runs."""
        pace = self.cfg.pace_step_s
        if quorum < len(self.membership.members_at(step)):
            pace = max(pace, self.cfg.degraded_pace_step_s)
        spent = time.time() - t0
        if pace and spent < pace:
            time.sleep(pace - spent)

    def train_step(self, step: int) -> StepResult:
        """One step of the replica groups' sync (``rank/every_step.py``, ``rank/diloco.py``)."""
        return self.sync.train_step(self, step)

    def _after_commit(self, result: StepResult) -> None:
        """The recovery span, the spike check (a non-finite step was refused: it is
        one), the checkpoint, and the phase's end."""
        if not result.finite:
            # A finite loss with a non-finite grad norm is just as bad a step.
            bad = result.loss if not math.isfinite(result.loss) else math.nan
            if not spiked(self, result.step + 1, bad, result.batch):
                from stages.errors import ErrorCode, ItoError

                raise ItoError(
                    ErrorCode.training_failed,
                    f"step {result.step + 1} is not finite (loss {result.loss}, "
                    f"grad norm {result.grad_norm}) and loss-spike handling is off",
                )
            pause(self, result.step, refused_batch=result.batch)
            return
        if not result.committed:
            return
        done = result.step + 1
        if self.recovering_since is not None and result.quorum >= len(
            self.membership.members_at(result.step)
        ):
            self.emit(
                PhaseEvent(phase="recovery", start=self.recovering_since, end=result.ended_at)
            )
            self.recovering_since = None
        # Spike check first: a checkpoint must never capture the spiking update.
        if spiked(self, done, result.loss, result.batch):
            pause(self, done)
            return
        # An objective that hands each committed version on (grpo: to the rollout fleet).
        publish = getattr(self.objective, "after_commit", None)
        if publish is not None:
            publish(done, result.loss, self)
        if done == self.phase.end_step:
            if not self._close_phase(done):
                self.control.send("stop")
            return  # a hold voted for now is voted again at the next step
        self.saver.save(done)
        if result.hold:
            hold(self, done)

    def restore(self, step: int) -> None:
        from stages.errors import ErrorCode, ItoError

        records = [r for r in self.checkpointer.records() if r.step == step]
        if not records:
            raise ItoError(ErrorCode.checkpoint_not_found, f"no complete checkpoint {step}")
        with self.sync.loading():
            self.checkpointer.load(records[0], self.train_state)
        phase = self.schedule.phase_of(step)
        if phase.index != self.phase.index:
            self.enter_phase(phase)
        if step <= phase.start_step:
            self.windows = []  # the previous phase's skipped windows index its own data
        steps = self.train_state.step
        self.manager.load_state_dict(
            {  # torchft: resume its step (with DiLoCo: its syncs) and batch count
                "step": self.sync.manager_step(steps),
                "batches_committed": self.loop_state.batches_committed,
            }
        )

    def _finish(self) -> None:
        # With DiLoCo the groups' weights agree only at a sync: none is saved mid-turn.
        if (
            (not self.control.stop or self.control.save_at_stop)
            and not self.sync.mid_turn
            and self.is_saver_at_end()
        ):
            self.saver.save(self.current_step(), force=True)
        if self.ckpt is not None:
            self.ckpt.close()
            self.saver.report()
        self.sync.close()
        self.status.enter(
            RankState.stopped if self.control.stop else RankState.finished,
            step=self.current_step(),
            digest=param_digest(self.model),
        )
        self.manager.shutdown(wait=False)  # torchft

    def is_saver_at_end(self) -> bool:
        try:
            return self.saver.is_saver()
        except Exception:
            return False

    @property
    def device(self) -> torch.device:
        return self.setup.device
