"""One objective's engine run the post-training comparisons share: SFT rows of mixed
lengths, the objective's train config over ``groups`` learner groups, the run on a
real ``TrainingEngine``, and its final checkpoint's weights; ``ReferenceRun`` is such a
run kept to compare another layout against."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.checkpointing.config import CheckpointPolicy
from stages.events import Event
from stages.post_training.config import OBJECTIVE_BUILDER
from stages.trainer.config import ModelSpec, ObjectiveConfig, TrainingTarget, TrainStageConfig

STEPS = 4
LR = 1e-3


def sft_rows(path: Path) -> Path:
    """Conversations of different lengths (one to three assistant turns), so a
    per-rank token mean would weigh rows differently from the global one."""
    with path.open("w") as f:
        for n in range(12):
            msgs: list[dict[str, str]] = []
            for k in range(1 + n % 3):
                msgs += [
                    {"role": "user", "content": f"Say {n + k}."},
                    {"role": "assistant", "content": f"{n + k} " * (1 + (n + k) % 4)},
                ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def objective_config(
    tmp: Path, policy: Path, data: Path, groups: int, **kw: Any
) -> TrainStageConfig:
    base: dict[str, Any] = dict(
        model=ModelSpec(preset="llama-tiny", size="tiny", checkpoint_path=str(policy)),
        target=TrainingTarget(
            max_steps=STEPS,
            seq_len=64,
            global_batch_tokens=64 * 4,
            learning_rate=LR,
            warmup_steps=0,
        ),
        checkpoint=CheckpointPolicy(interval_steps=100, keep=2, storage_uri=f"file://{tmp}/ckpt"),
        replica_groups=groups,
        objective=ObjectiveConfig(
            kind="sft",
            builder=OBJECTIVE_BUILDER,
            data_path=str(data),
            batch_size=4,
            max_length=64,
        ),
        spare_groups=0,
    )
    base.update(kw)
    return TrainStageConfig.model_validate(base, strict=False)


def train_on_engine(cfg: TrainStageConfig, tmp: Path, run_id: str) -> tuple[Any, list[Event]]:
    from stages.trainer.fleet.engine import TrainingEngine

    events: list[Event] = []
    ckpt = tmp / "ckpt" / run_id
    ckpt.mkdir(parents=True)
    engine = TrainingEngine(
        cfg,
        run_id=run_id,
        checkpoint_dir=ckpt,
        role_shards={},
        emit=events.append,
        cancel_event=threading.Event(),
        wait_decision=lambda _id, _t: None,
    )
    return engine.run(), events


def final_weights(cfg: TrainStageConfig, checkpoint: str) -> dict[str, torch.Tensor]:
    from stages.checkpointing.seal import CheckpointBinding
    from stages.trainer.phase_eval import load_phase_model, sealed_checkpoint

    phase = cfg.schedule.phases[0]
    run = CheckpointBinding(run_id=Path(checkpoint).parent.name)  # <ckpt>/<run id>/step_<n>
    return load_phase_model(cfg, phase, sealed_checkpoint(checkpoint, run, phase.name)).state_dict()


@dataclass(frozen=True)
class ReferenceRun:
    """A finished engine run the comparisons hold another layout against."""

    cfg: Any  # its TrainStageConfig
    result: Any  # the engine's EngineResult
    events: list[Any]
    weights: dict[str, Any]  # its final checkpoint's state dict

    def assert_trains_the_same(self, cfg: Any) -> None:
        """``cfg`` trains what this run trained, in another layout: the same target and
        objective, on rows of the same bytes."""
        assert cfg.target == self.cfg.target
        mine, theirs = (c.objective.model_copy(update={"data_path": None}) for c in (self.cfg, cfg))
        assert mine == theirs
        rows = (Path(c.objective.data_path).read_bytes() for c in (self.cfg, cfg))
        assert next(rows) == next(rows)
