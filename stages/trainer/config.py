"""Typed configs of the training engine (the manifest embeds them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from stages.base import StrictModel
from stages.checkpointing.config import CheckpointPolicy
from stages.curriculum.schedule import CurriculumSchedule, one_phase_schedule
from stages.errors import ErrorCode, ItoError
from stages.evals.config import EvalRunSettings
from stages.netfront import FrontConfig
from stages.pathfields import PathField
from stages.replica_sync import ReplicaSync
from stages.trainer.parallel.layout import ParallelLayout


class ModelSpec(StrictModel):
    preset: str = Field(description="Name of a configs/models preset, e.g. llama-tiny")
    architecture: Literal["llama"] = "llama"
    size: str = Field(description="Human label of the size, e.g. '124K' or '8B'")
    revision: str = Field(default="random-init", max_length=128)
    # A local Hugging Face checkpoint folder; None builds from the preset, random init.
    checkpoint_path: Annotated[
        str | None,
        PathField(
            "model",
            "dir",
            exists=True,
            contains=("config.json",),
            invalid=ErrorCode.model_checkpoint_invalid,
        ),
    ] = Field(default=None, max_length=4096)
    # A local tokenizer folder (save_pretrained layout); None trains a byte-level BPE
    # with the preset's vocab_size on the run's prepared data.
    tokenizer_path: Annotated[
        str | None,
        PathField(
            "model",
            "dir",
            exists=True,
            contains=("tokenizer.json",),
            invalid=ErrorCode.tokenizer_invalid,
        ),
    ] = Field(default=None, max_length=4096)


# Upper bounds a real run stays far below (the largest public runs: ~15T tokens, ~16M
# tokens a batch, 128K context): validation and the planner never see magnitudes
# that only an attack would send.
MAX_STEPS = 100_000_000
MAX_TOKENS = 10**15
MAX_BATCH_TOKENS = 1 << 30
MAX_SEQ_LEN = 1 << 21


AdamBeta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
# AdamW's (beta1, beta2). A manifest's JSON array is a list: this field takes it as the
# pair (the models are strict, which would refuse a list for a tuple).
AdamBetas = Annotated[tuple[AdamBeta, AdamBeta], Field(strict=False)]


class TrainingTarget(StrictModel):
    max_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    target_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)
    seq_len: int = Field(default=128, gt=1, le=MAX_SEQ_LEN)
    global_batch_tokens: int = Field(gt=0, le=MAX_BATCH_TOKENS)
    learning_rate: float = Field(default=3e-4, gt=0, le=10, allow_inf_nan=False)
    warmup_steps: int = Field(default=10, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(default=0.1, ge=0, le=10, allow_inf_nan=False)
    grad_clip: float = Field(default=1.0, gt=0, le=1e6, allow_inf_nan=False)
    # AdamW's (beta1, beta2): pretraining's usual 0.95; post-training objectives pass
    # the recipe's (trl's default 0.999).
    adam_betas: AdamBetas = Field(default=(0.9, 0.95), max_length=2)
    seed: int = Field(default=0, ge=0, lt=2**63)
    deterministic: bool = True

    @model_validator(mode="after")
    def _one_target(self) -> TrainingTarget:
        if (self.max_steps is None) == (self.target_tokens is None):
            raise ValueError("set exactly one of max_steps and target_tokens")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError("global_batch_tokens must be a multiple of seq_len")
        return self

    @property
    def steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        assert self.target_tokens is not None
        return -(-self.target_tokens // self.global_batch_tokens)


class LossSpikeConfig(StrictModel):
    """Rolling robust z-score (median / MAD) on the loss."""

    enabled: bool = True
    window: int = Field(default=50, ge=5, le=100_000)
    z_threshold: float = Field(default=6.0, gt=0, le=1000)
    min_steps: int = Field(
        default=20, ge=1, le=100_000_000, description="steps before detection starts"
    )
    skip_window_steps: int = Field(
        default=10, ge=1, le=1_000_000, description="data window to skip on restart"
    )


class FaultToleranceConfig(StrictModel):
    """Every torchft / Ray timeout of the engine, in one place.

    Defaults are measured on the 2-core CPU testbed (see docs/training-engine.md and
    benchmarks/quorum_stability.py): a SIGKILLed group is noticed in about
    ``heartbeat_timeout_ms + quorum_tick_ms`` with two groups, and a 1 s heartbeat
    timeout had no spurious quorum change with every core busy (500 ms was stable
    too, 200 ms marginal, 100 ms unusable).
    """

    enabled: bool = True
    # Lighthouse: a replica group missing heartbeats this long is dropped from the quorum.
    heartbeat_timeout_ms: int = Field(default=1000, ge=50)
    # Lighthouse: how long a quorum waits for a live (still heartbeating) but slow group
    # before forming without it. A dead group stops heartbeating and is dropped after
    # heartbeat_timeout_ms whatever this is, so it only trades stragglers against
    # spurious shrinks under load: generous.
    join_timeout_ms: int = Field(default=5000, ge=50)
    # Lighthouse: how often it re-evaluates the quorum.
    quorum_tick_ms: int = Field(default=100, ge=10)
    # Manager -> lighthouse heartbeat period; must be well below heartbeat_timeout_ms.
    heartbeat_interval_ms: int = Field(default=100, ge=10)
    # Manager: waiting for a quorum; must exceed heartbeat_timeout_ms (else the survivor
    # times out before the dead group is dropped).
    quorum_timeout_s: float = Field(default=30.0, gt=0)
    # DiLoCo: how long a sync's quorum waits for a live group that has not reached the
    # sync yet (groups drift apart over a turn's inner steps on busier or slower
    # devices, seconds on a loaded host; a restarted group waits for its peers' next
    # sync). It is the join timeout of a DiLoCo run's lighthouse and lengthens its
    # Managers' quorum_timeout_s by as much; a lost group stops heartbeating and is
    # dropped after heartbeat_timeout_ms whatever this is.
    sync_wait_s: float = Field(default=300.0, gt=0, le=86_400)
    # Manager: collectives, should_commit, healing transfers (torchft's "timeout").
    timeout_s: float = Field(default=30.0, gt=0)
    # Manager: establishing RPC connections to the lighthouse and peer managers.
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Gloo collective timeout: how long a hung (not dead) peer can block an allreduce.
    collective_timeout_s: float = Field(default=30.0, gt=0)
    # Minimum replica groups for a step to commit (torchft min_replica_size).
    min_replica_groups: int = Field(default=1, ge=1)
    # The fronts of the run's torchft servers (connection limit, preface deadline...):
    # torchft's servers take no credential, the front admits the run's nodes only.
    front: FrontConfig = Field(default_factory=FrontConfig)
    # Reading the lighthouse's status page over loopback for an SRE (quorum_status): a
    # local page, so a short bound; a lighthouse stuck that long is itself the answer.
    lighthouse_status_timeout_s: float = Field(default=2.0, gt=0, le=60)
    # The status page lists every replica's heartbeat (~100 bytes each): 1 MiB holds
    # thousands of groups and bounds what one read holds in memory.
    lighthouse_status_max_bytes: int = Field(default=2**20, ge=1024, le=64 * 2**20)
    # A rank's heal server: connections served at once. A heal takes one per healing
    # rank; a stranger's holds a slot at most the handshake timeout, and a flood beyond
    # this is closed unserved instead of spawning a thread per connection.
    heal_max_connections: int = Field(default=16, ge=1, le=1024)
    # Ray restarts of one worker actor before the run gives up on it.
    max_restarts: int = Field(default=8, ge=0)
    # Driver: a grow's new groups are launched again when one fails before it trains
    # (a process lost while it builds or joins), up to this many launches in all; then
    # the resize is refused and the run keeps its groups.
    resize_join_attempts: int = Field(default=3, ge=1, le=10)
    # Driver: how long a worker may stay unreachable before its group counts as lost
    # for the all-groups-lost decision.
    actor_ready_timeout_s: float = Field(default=120.0, gt=0)
    # A restarted or standby rank asking the other groups whether a live peer is ahead
    # of every checkpoint (then it heals from the peer and reads no checkpoint).
    peer_probe_timeout_s: float = Field(default=2.0, gt=0)
    # Driver: how often it pulls events from the actors.
    poll_interval_s: float = Field(default=0.2, gt=0)
    # Driver: polls per second, over all its ranks, for ranks that committed a phase's
    # last step and are saving its closing checkpoint, so the gate starts as the save
    # completes (the whole fleet waits at the boundary meanwhile). Each such rank is
    # polled every ranks / this seconds, at most poll_interval_s: every 20 ms with 2
    # ranks, at the regular interval with 20 or more.
    phase_end_polls_per_s: float = Field(default=100.0, gt=0)
    # Driver: cancel kills every actor; a graceful stop waits at most this long first.
    stop_timeout_s: float = Field(default=5.0, gt=0)
    # Driver: a run pausing for capacity waits this long for its saving group's
    # checkpoint before the ranks are killed (a large model's takes minutes to write).
    pause_save_timeout_s: float = Field(default=900.0, gt=0)
    # Rank: the first step after the member groups changed (a resize, a resume, the
    # run's start) is refused and tried again while a member is not in its quorum (a
    # group still starting under load), for at most this long; then it trains without
    # the missing group, whose share is skipped as a lost group's is.
    member_wait_s: float = Field(default=60.0, gt=0)
    # Driver: a paused run (loss-spike proposal) re-checks cancellation this often while
    # it waits for the human decision.
    decision_poll_s: float = Field(default=1.0, gt=0)
    # Driver: give up waiting for a human decision after this long (None: wait forever).
    decision_timeout_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> FaultToleranceConfig:
        if self.quorum_timeout_s * 1000 <= self.heartbeat_timeout_ms:
            raise ValueError("quorum_timeout_s must exceed heartbeat_timeout_ms")
        if self.heartbeat_interval_ms * 2 > self.heartbeat_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be at most half heartbeat_timeout_ms")
        return self


class LossSpikeInjection(StrictModel):
    """Test knob: multiply the loss of some data batches (poisoned data).

    Keyed by the data batch index, not the step, so that skipping the window on an
    approved restart really removes the poison."""

    batches: list[int] = Field(min_length=1, max_length=16)
    scale: float = Field(default=50.0, gt=0)


class GRPOSettings(StrictModel):
    """The GRPO/DAPO learner's loss settings (``stages.post_training.grpo_objective``),
    from the recipe's rlvr objective."""

    epsilon: float = Field(default=0.2, gt=0, lt=1)
    epsilon_high: float = Field(default=0.28, gt=0, le=10)
    temperature: float = Field(default=1.0, gt=0, le=10)
    # Decoupled importance sampling: the behaviour weight prox/behav truncated here;
    # None: no correction (the ratio is to the proximal policy only).
    is_truncation: float | None = Field(default=2.0, gt=0, le=1e3)
    beta: float = Field(default=0.0, ge=0, le=1e3)
    # How long a rank waits for the driver's batch file of its step.
    batch_wait_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    # Where rank 0 leaves each committed version for the rollout fleet
    # (stages.post_training.weight_board): the driver's board actor (None: no fleet,
    # nothing published), the weight path, the fleet's size and the collective's settings.
    weights_board: str | None = Field(default=None, min_length=1, max_length=256)
    weight_sync: Literal["object_store", "collective"] = "object_store"
    fleet_workers: int = Field(default=0, ge=0, le=4096)
    weight_sync_bucket_bytes: int = Field(default=64 << 20, ge=1 << 10, le=16 << 30)
    weight_sync_timeout_s: float = Field(default=300.0, gt=0, le=3600)


class ObjectiveConfig(StrictModel):
    """What the engine trains for (``stages.trainer.rank.objective``): ``lm`` pretraining on
    the token shards, or a post-training objective on a JSONL file of rows (sft, dpo)
    or on the rollout batches the RLVR controller writes (grpo)."""

    kind: Literal["lm", "sft", "dpo", "grpo"] = "lm"
    # sft: conversational rows ({"messages": [...]}); dpo: preference rows (prompt,
    # chosen, rejected). A private snapshot the stage made and checked, never the
    # tenant's file itself. grpo: the folder of the controller's step batches.
    data_path: str | None = Field(default=None, max_length=4096)
    grpo: GRPOSettings | None = None
    # Rows (sft), pairs (dpo) or completions (grpo) per optimizer step over the whole
    # run, split evenly over every data-parallel rank of every replica group.
    batch_size: int = Field(default=4, ge=1, le=1 << 20)
    max_length: int = Field(default=256, ge=8, le=MAX_SEQ_LEN)
    # dpo: the sigmoid loss's beta (trl's DPOConfig.beta).
    beta: float = Field(default=0.1, gt=0, le=1e3, allow_inf_nan=False)
    # A post-training objective's builder, named by the stage that trains it
    # ("stages.<module>:<function>", ``stages.trainer.rank.objective.ObjectiveBuilder``): each
    # rank builds what its config names, and the engine never imports the stages above.
    builder: str | None = Field(
        default=None, pattern=r"^stages(\.[a-z_][a-z0-9_]*)+:[a-z_][a-z0-9_]*$"
    )

    @model_validator(mode="after")
    def _data(self) -> ObjectiveConfig:
        if (self.kind == "lm") != (self.data_path is None):
            raise ValueError("objective.data_path is set exactly for the post-training objectives")
        if (self.kind == "lm") != (self.builder is None):
            raise ValueError("objective.builder is set exactly for the post-training objectives")
        if (self.kind == "grpo") != (self.grpo is not None):
            raise ValueError("objective.grpo is set exactly for the grpo objective")
        return self


class TrainStageConfig(StrictModel):
    """The training stage: model, target, checkpoints, spikes, fault tolerance, layout."""

    model: ModelSpec
    target: TrainingTarget
    checkpoint: CheckpointPolicy
    loss_spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    replica_groups: int = Field(default=2, ge=1, le=64)
    ranks_per_group: int = Field(default=1, ge=1, le=64)
    # Pre-started, warmed-up standby groups (each of ``ranks_per_group`` ranks): one
    # takes a lost group's place at once (process start-up is most of the resume time).
    spare_groups: int = Field(default=0, ge=0, le=8)
    device: Literal["cpu", "cuda"] = "cpu"
    # jsonl files with a "text" field; empty: ctx.previous["data_prep"] artifacts.
    train_files: list[str] = Field(default_factory=list)
    text_field: str = "text"
    # Fractional logical CPUs per worker actor (Ray scheduling only).
    worker_num_cpus: float = Field(default=0.5, gt=0)
    # On cpu, pin each replica group's ranks to their own share of the node's cores
    # (sched_setaffinity): a lost group's compute then stays idle, as a lost GPU's
    # would, instead of speeding up the survivors that share its cores.
    pin_group_cores: bool = True
    # Test/benchmark pacing: minimum seconds per step, so that a tiny CPU model's run
    # lasts long enough to kill and restart a group in it. 0 in real runs.
    pace_step_s: float = Field(default=0.0, ge=0, le=10)
    # Test/benchmark pacing while a replica group is missing from the quorum: a run
    # then outlasts a lost group's restart (however slow the host) and, once the group
    # rejoined, goes on at ``pace_step_s``. 0 in real runs.
    degraded_pace_step_s: float = Field(default=0.0, ge=0, le=10)
    # Test-only fault injection; never set by a tenant manifest.
    inject_loss_spike: LossSpikeInjection | None = None
    # Curriculum: the phases' schedule (None: the whole target as one phase, cosine LR,
    # no gate; see ``schedule``).
    curriculum: CurriculumSchedule | None = None
    # How eval batteries run at phase ends (timeouts, sizes); the checks are fixed.
    evals: EvalRunSettings = Field(default_factory=EvalRunSettings)
    # Documents of each role held out from training for the held-out checks.
    heldout_permille: int = Field(default=20, ge=0, le=500)
    heldout_min_docs: int = Field(default=8, ge=0)

    # The layout inside each replica group (the planner's tp, pp, cp, dp_shard,
    # schedule, recompute, precision); tp x pp x cp x dp_shard = ranks_per_group.
    parallel: ParallelLayout = Field(default_factory=ParallelLayout)
    # The objective: lm pretraining unless a post-training stage names sft or dpo.
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    # How the replica groups keep their weights together: every step, or DiLoCo every
    # ``sync.sync_every`` steps (the planner's choice from the fabric, or the manifest's).
    sync: ReplicaSync = Field(default_factory=ReplicaSync)

    @model_validator(mode="after")
    def _layout_fits(self) -> TrainStageConfig:
        try:
            layout = self.parallel.resolved(self.ranks_per_group)
        except ItoError as e:
            raise ValueError(e.message) from e
        kind = self.objective.kind
        if kind != "lm" and (layout.pp > 1 or layout.cp > 1):
            # Raised as is (pydantic passes non-ValueErrors through): a plan refusal.
            raise ItoError(
                ErrorCode.plan_objective_unsupported,
                f"the {kind} objective runs without pipeline or context parallelism "
                f"(pp={layout.pp}, cp={layout.cp}); use tp and dp_shard",
            )
        if kind != "lm" and self.objective.batch_size % self.dp_world:
            raise ValueError(
                f"objective.batch_size {self.objective.batch_size} does not split over "
                f"{self.dp_world} data-parallel ranks"
            )
        if self.micro_batch % layout.grad_accum:
            raise ValueError(
                f"{self.micro_batch} sequences per data-parallel rank do not "
                f"split into {layout.grad_accum} accumulation steps"
            )
        if layout.pp > 1 and self.micro_batch % layout.pp_microbatches:
            raise ValueError(
                f"{self.micro_batch} sequences per data-parallel rank do not "
                f"split into {layout.pp_microbatches} pipeline micro-batches"
            )
        self._sync_fits()
        return self

    def _sync_fits(self) -> None:
        """DiLoCo's syncs are the only points where the groups' weights agree: phases
        (their gates, evals and exports) and checkpoints must fall on them."""
        sync = self.sync
        if sync.every_step:
            return
        if self.objective.kind != "lm":
            raise ItoError(
                ErrorCode.plan_sync_invalid,
                f"diloco runs language-model pretraining; the {self.objective.kind} "
                "objective syncs every step",
            )
        interval = self.checkpoint.interval_steps
        if interval is not None and interval % sync.sync_every:
            raise ItoError(
                ErrorCode.plan_sync_invalid,
                f"checkpoint.interval_steps {interval} is not a multiple of diloco's "
                f"sync_every {sync.sync_every}: a checkpoint is taken where groups agree",
            )
        for phase in self.schedule.phases:
            if phase.end_step % sync.sync_every:
                raise ItoError(
                    ErrorCode.plan_sync_invalid,
                    f"phase {phase.name!r} ends at step {phase.end_step}, not a multiple "
                    f"of diloco's sync_every {sync.sync_every}: a phase's gate judges "
                    "weights every group shares",
                )

    def lighthouse_settings(self) -> FaultToleranceConfig:
        """The run's lighthouse's settings: DiLoCo's syncs wait ``sync_wait_s`` for a
        live group behind (every-step groups are in step: the join timeout as is)."""
        ft = self.fault_tolerance
        if self.sync.every_step:
            return ft
        return ft.model_copy(update={"join_timeout_ms": round(ft.sync_wait_s * 1000)})

    @property
    def layout(self) -> ParallelLayout:
        """The group layout with dp_shard and the micro-batch count resolved."""
        return self.parallel.resolved(self.ranks_per_group)

    @property
    def schedule(self) -> CurriculumSchedule:
        """The phases the loop follows: the curriculum, or the whole target as one."""
        if self.curriculum is not None:
            return self.curriculum
        t = self.target
        return one_phase_schedule(
            total_steps=t.steps,
            global_batch_tokens=t.global_batch_tokens,
            seq_len=t.seq_len,
            learning_rate=t.learning_rate,
            warmup_steps=t.warmup_steps,
        )

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_at(self.target.seq_len)

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks of the run: replica groups x their dp_shard ranks."""
        return self.replica_groups * self.parallel.resolved(self.ranks_per_group).dp_shard

    def micro_batch_at(self, seq_len: int) -> int:
        """Sequences (sft) or pairs (dpo) per data-parallel rank per step at ``seq_len``
        (the global batch split over the replica groups and their dp_shard ranks; TP,
        PP and CP ranks share a batch)."""
        if self.objective.kind != "lm":
            return self.objective.batch_size // self.dp_world
        seqs = self.target.global_batch_tokens // seq_len
        return max(1, seqs // self.dp_world)
