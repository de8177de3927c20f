"""The curriculum's schedule: the phases in order, each trainer phase with its steps,
sequence length, data mix, LR schedule and RoPE base, computed once from the manifest
(pure, no torch).

The global batch stays ``global_batch_tokens``; a phase with a longer sequence
length trains fewer, longer sequences per step. A phase's token budget is its
``token_fraction`` of the training target; steps are numbered globally, so phase
``k`` owns steps ``[start_step, end_step)`` and a checkpoint's step says which
phase it belongs to. ``post_training`` phases are not the trainer's: they are
listed, with no steps, for the post-training stage.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from stages.curriculum.config import TRAINER_KINDS, CurriculumConfig, DataRole, GateThreshold
from stages.errors import ErrorCode, ItoError


class PhaseSpan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int
    name: str
    kind: str
    start_step: int
    end_step: int
    seq_len: int
    token_budget: int
    data_weights: dict[DataRole, float]
    # None: the phase closes with a kept checkpoint and no battery (a run without a
    # curriculum is one such phase).
    eval_battery: str | None
    gates: list[GateThreshold] = Field(default_factory=list)
    lr_schedule: str = "wsd"
    peak_lr: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    rope_theta: float | None = None

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step

    def lr(self, step: int) -> float:
        """The LR of global ``step`` (stateless: healing needs no scheduler state)."""
        i = step - self.start_step
        n = max(1, self.steps)
        peak, floor = self.peak_lr, self.peak_lr * self.min_lr_ratio
        if self.warmup_steps and i < self.warmup_steps:
            return peak * (i + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return peak
        if self.lr_schedule == "cosine":
            span = max(1, n - self.warmup_steps)
            p = min(1.0, (i - self.warmup_steps) / span)
            return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * p))
        decay_start = n - self.decay_steps
        if i < decay_start or self.decay_steps == 0:
            return peak
        # Linear decay to the floor over the last decay_steps, reaching it at the last step.
        p = (i - decay_start + 1) / self.decay_steps
        return peak + (floor - peak) * p


class CurriculumSchedule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    total_steps: int
    global_batch_tokens: int
    phases: list[PhaseSpan]
    post_training: list[str] = Field(default_factory=list)

    def phase_of(self, step: int) -> PhaseSpan:
        """The phase that trains ``step`` (a phase's end step belongs to the next)."""
        for p in self.phases:
            if p.start_step <= step < p.end_step:
                return p
        return self.phases[-1]


def one_phase_schedule(
    *,
    total_steps: int,
    global_batch_tokens: int,
    seq_len: int,
    learning_rate: float,
    warmup_steps: int,
) -> CurriculumSchedule:
    """A run without a curriculum: one pretrain phase over every step, warmup then
    cosine decay to 10% of the peak, no eval battery and no gate."""
    return CurriculumSchedule(
        total_steps=total_steps,
        global_batch_tokens=global_batch_tokens,
        phases=[
            PhaseSpan(
                index=0,
                name="train",
                kind="pretrain",
                start_step=0,
                end_step=total_steps,
                seq_len=seq_len,
                token_budget=total_steps * global_batch_tokens,
                # Every role weighs 1, as a curriculum phase's unnamed roles do.
                data_weights={"baseline": 1.0, "custom": 1.0},
                eval_battery=None,
                lr_schedule="cosine",
                peak_lr=learning_rate,
                warmup_steps=min(warmup_steps, total_steps),
                decay_steps=0,
                min_lr_ratio=0.1,
            )
        ],
    )


def ntk_rope_theta(theta: float, head_dim: int, scale: float) -> float:
    """NTK-aware RoPE base for a context ``scale`` times longer (Code Llama style)."""
    if scale <= 1:
        return theta
    scaled: float = theta * scale ** (head_dim / (head_dim - 2))
    return scaled


def schedule_curriculum(
    curriculum: CurriculumConfig,
    *,
    total_steps: int,
    base_seq_len: int,
    global_batch_tokens: int,
    learning_rate: float,
    warmup_steps: int,
    rope_theta: float | None = None,
    head_dim: int | None = None,
    max_positions: int | None = None,
) -> CurriculumSchedule:
    """Steps and settings of every trainer phase; raises ``curriculum_invalid``."""
    trainer = [p for p in curriculum.phases if p.kind in TRAINER_KINDS]
    post = [p.name for p in curriculum.phases if p.kind not in TRAINER_KINDS]
    if not trainer:
        raise ItoError(ErrorCode.curriculum_invalid, "no pretrain/mid_train/long_context phase")
    frac_total = sum(p.token_fraction for p in trainer)
    first_seq = trainer[0].seq_len or base_seq_len
    prev_seq = first_seq
    out: list[PhaseSpan] = []
    start = 0
    for i, p in enumerate(trainer):
        seq = p.seq_len or (prev_seq if i else base_seq_len)
        if global_batch_tokens % seq:
            raise ItoError(
                ErrorCode.curriculum_invalid,
                f"phase {p.name}: global_batch_tokens {global_batch_tokens} is not "
                f"a multiple of its seq_len {seq}",
            )
        if p.kind == "long_context" and seq <= prev_seq:
            raise ItoError(
                ErrorCode.curriculum_invalid,
                f"phase {p.name} is long_context but its seq_len {seq} does not "
                f"raise the previous {prev_seq}",
            )
        if max_positions is not None and seq > max_positions:
            raise ItoError(
                ErrorCode.curriculum_invalid,
                f"phase {p.name}: seq_len {seq} > the model's {max_positions} positions",
            )
        if i == len(trainer) - 1:
            end = total_steps
        else:
            end = start + max(1, round(total_steps * p.token_fraction / frac_total))
        if end <= start or end > total_steps - (len(trainer) - 1 - i):
            raise ItoError(
                ErrorCode.curriculum_invalid,
                f"{total_steps} steps are too few for {len(trainer)} phases",
            )
        steps = end - start
        warm = p.warmup_steps if p.warmup_steps is not None else (warmup_steps if i == 0 else 0)
        warm = min(warm, steps)
        theta = p.rope_theta
        if theta is None and rope_theta is not None and head_dim:
            theta = ntk_rope_theta(rope_theta, head_dim, seq / first_seq)
        weights = {r: float(p.data_weights.get(r, 1.0)) for r in p.data_roles}
        out.append(
            PhaseSpan(
                index=i,
                name=p.name,
                kind=p.kind,
                start_step=start,
                end_step=end,
                seq_len=seq,
                token_budget=steps * global_batch_tokens,
                data_weights=weights,
                eval_battery=p.eval_battery,
                gates=list(p.gates),
                lr_schedule=p.lr_schedule,
                peak_lr=learning_rate * p.lr_scale,
                warmup_steps=warm,
                decay_steps=min(steps - warm, round(steps * p.decay_fraction)),
                min_lr_ratio=p.min_lr_ratio,
                rope_theta=theta,
            )
        )
        start, prev_seq = end, seq
    return CurriculumSchedule(
        total_steps=total_steps,
        global_batch_tokens=global_batch_tokens,
        phases=out,
        post_training=post,
    )
