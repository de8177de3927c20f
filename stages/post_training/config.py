"""Post-training recipe: SFT -> DPO -> RLVR (GRPO with the DAPO fixes).

The manifest names any prefix of the chain; each objective ends with its gate. Every
timeout of the rollout fleet is a named setting here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from stages.base import StrictModel
from stages.data_prep.config import DataRef
from stages.errors import ErrorCode
from stages.evals.config import GateThreshold
from stages.pathfields import PathField
from stages.trainer.config import AdamBetas

# What a rank calls to build a post-training objective (``ObjectiveConfig.builder``):
# the engine imports it by this name on the rank, and never imports this stage.
OBJECTIVE_BUILDER = "stages.post_training.objectives:build_objective"

MAX_STEPS = 100_000_000
# trl's trainers inherit transformers' TrainingArguments defaults.
TRL_ADAM_BETAS = (0.9, 0.999)


class ObjectiveGate(StrictModel):
    """An objective passes when ``metric`` (from its eval battery) is ``>= min``."""

    metric: str = Field(min_length=1, max_length=64)
    min: float = Field(ge=-1e12, le=1e12, allow_inf_nan=False)


class ObjectiveBattery(StrictModel):
    """The curriculum's eval battery after an objective (``configs/evals/<battery>.json``),
    gated like a curriculum phase (min / max / max_regression vs the previous objective)."""

    battery: str | None = Field(default=None, max_length=64)
    gates: list[GateThreshold] = Field(default_factory=list, max_length=32)


class SFTConfig(StrictModel):
    """SFT on the engine (trl ``SFTTrainer``'s loss) on conversational JSONL
    (``{"messages": [{role, content}...]}``)."""

    data: DataRef
    steps: int = Field(gt=0, le=MAX_STEPS)
    learning_rate: float = Field(default=2e-5, gt=0, le=10, allow_inf_nan=False)
    batch_size: int = Field(default=4, ge=1, le=4096)
    max_length: int = Field(default=256, ge=8, le=1 << 20)
    # A checkpoint every this many steps during the objective (a relaunched driver
    # resumes the objective from the newest); 0: only the objective's closing one.
    checkpoint_every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    # AdamW's betas: trl's default (TrainingArguments adam_beta1/adam_beta2).
    adam_betas: AdamBetas = Field(default=TRL_ADAM_BETAS, max_length=2)
    # Battery: mean assistant-token NLL on the data before and after; gain = before - after.
    gate: ObjectiveGate | None = Field(
        default_factory=lambda: ObjectiveGate(metric="nll_gain", min=0.0)
    )
    eval: ObjectiveBattery = Field(default_factory=ObjectiveBattery)


class DPOConfig(StrictModel):
    """DPO on the engine (trl ``DPOTrainer``'s sigmoid loss) on preference JSONL
    (``prompt``/``chosen``/``rejected``)."""

    data: DataRef
    steps: int = Field(gt=0, le=MAX_STEPS)
    beta: float = Field(default=0.1, gt=0, le=1e3, allow_inf_nan=False)
    learning_rate: float = Field(default=5e-7, gt=0, le=10, allow_inf_nan=False)
    batch_size: int = Field(default=4, ge=1, le=4096)
    max_length: int = Field(default=256, ge=8, le=1 << 20)
    # A checkpoint every this many steps during the objective (a relaunched driver
    # resumes the objective from the newest); 0: only the objective's closing one.
    checkpoint_every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    # AdamW's betas: trl's default (TrainingArguments adam_beta1/adam_beta2).
    adam_betas: AdamBetas = Field(default=TRL_ADAM_BETAS, max_length=2)
    # Battery: mean log-prob margin (chosen - rejected) before and after.
    gate: ObjectiveGate | None = Field(
        default_factory=lambda: ObjectiveGate(metric="margin_gain", min=0.0)
    )
    eval: ObjectiveBattery = Field(default_factory=ObjectiveBattery)


class RLVRConfig(StrictModel):
    """GRPO with DAPO: clip-higher, dynamic sampling, token-level loss, overlong shaping."""

    data: DataRef
    steps: int = Field(gt=0, le=MAX_STEPS)
    reward: str = Field(
        default="gsm8k_exact_match",
        max_length=64,
        description="a name in the reward registry (stages.post_training.rewards)",
    )
    group_size: int = Field(default=8, ge=2, le=1024)
    groups_per_step: int = Field(default=4, ge=1, le=4096)
    learning_rate: float = Field(default=1e-6, gt=0, le=10, allow_inf_nan=False)
    temperature: float = Field(default=1.0, gt=0, le=10)
    epsilon: float = Field(default=0.2, gt=0, lt=1, description="clip-low")
    epsilon_high: float = Field(default=0.28, gt=0, le=10, description="clip-higher")
    beta: float = Field(
        default=0.0, ge=0, le=1e3, description="KL to the reference; 0 = no KL term"
    )
    scale_rewards: bool = Field(default=True, description="divide advantages by the group std")
    dynamic_sampling: bool = True
    # Dynamic sampling bound: uniform-reward groups dropped per step before the step
    # trains on what it has (the extra uniform groups then carry zero advantage).
    max_dropped_groups_per_step: int = Field(default=16, ge=0, le=4096)
    max_completion_tokens: int = Field(default=256, gt=0, le=1 << 20)
    # Prompts longer than this (chat template included) are left out, as SFT and DPO
    # leave out examples over max_length; the planner sizes the learner's step at
    # max_prompt_tokens + max_completion_tokens.
    max_prompt_tokens: int = Field(default=512, gt=0, le=1 << 20)
    overlong_buffer_tokens: int = Field(default=64, ge=0, le=1 << 20)
    overlong_penalty_factor: float = Field(default=1.0, ge=0, le=1e3)
    mask_truncated_completions: bool = False
    # Stale-sample correction: decoupled PPO (ratio to the trainer's proximal policy,
    # behaviour weight prox/behav truncated at ``is_truncation``).
    is_correction: Literal["decoupled", "none"] = "decoupled"
    is_truncation: float = Field(default=2.0, gt=0, le=1e3)
    rollout_workers: int = Field(default=1, ge=1, le=1024)
    max_staleness: int = Field(
        default=1, ge=0, le=1024, description="policy versions a rollout may lag"
    )
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    # How versions reach the fleet (stages.post_training.weight_sync): Ray's object
    # store, or flat buckets from the learner's own listener to every worker that
    # proves the run's weight-sync key. The collective path does not survive a worker
    # restart (a version sent is not sent again): the run fails after the timeout.
    weight_sync: Literal["object_store", "collective"] = "object_store"
    weight_sync_bucket_mb: int = Field(default=64, ge=1, le=16_384)
    weight_sync_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    # Resume state (policy, optimizer, version, the fleet's request cursor) saved into
    # the run's workdir every this many steps; 0: never. A rerun resumes from the newest.
    checkpoint_every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    # Named timeouts of the fleet. Ready: worker 0's prompt encoding, then every worker's
    # process up at RLVR's start (a worker Ray cannot place fails the fleet here).
    worker_ready_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    worker_restart_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    rollout_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    gate: ObjectiveGate | None = Field(
        default_factory=lambda: ObjectiveGate(metric="reward_gain", min=0.0)
    )
    eval: ObjectiveBattery = Field(default_factory=ObjectiveBattery)

    @model_validator(mode="after")
    def _check(self) -> RLVRConfig:
        if self.overlong_buffer_tokens >= self.max_completion_tokens:
            raise ValueError("overlong_buffer_tokens must be below max_completion_tokens")
        return self


class PostTrainingConfig(StrictModel):
    # file:///abs path of a local HF model folder (config, weights, tokenizer with a chat
    # template); None: the pretraining stage's HF export.
    base_model: Annotated[
        str | None,
        PathField(
            "model",
            "dir",
            exists=True,
            contains=("config.json", "tokenizer_config.json"),
            invalid=ErrorCode.post_training_model_invalid,
        ),
    ] = Field(default=None, max_length=2048)
    # The base model folder's digest, by the folder rule over every file in it (sha256
    # of the sorted "<relative path>\t<file sha256>\n" lines, stages/snapshot.py): the
    # run trains only on the bytes this names.
    base_model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    sft: SFTConfig | None = None
    dpo: DPOConfig | None = None
    rlvr: RLVRConfig | None = None

    @model_validator(mode="after")
    def _pinned(self) -> PostTrainingConfig:
        if (self.base_model is None) != (self.base_model_sha256 is None):
            raise ValueError("base_model and base_model_sha256 go together")
        return self

    def objectives(self) -> list[str]:
        return [s for s in ("sft", "dpo", "rlvr") if getattr(self, s) is not None]
