"""Small trainer configs the tests build without a manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.trainer.config import TrainStageConfig


def two_group_tiny_config(tmp: Path, **over: Any) -> TrainStageConfig:
    """llama-tiny over 2 replica groups, 12 sequences of 32 tokens a step (1, 2, 3, 4, 6
    and 12 groups split it evenly), 10 steps, a checkpoint every 5 under ``tmp/ckpt``;
    ``over`` sets further top-level fields."""
    return TrainStageConfig.model_validate(
        dict(
            model={"preset": "llama-tiny", "size": "0.1M"},
            target={"max_steps": 10, "seq_len": 32, "global_batch_tokens": 384},
            checkpoint={"interval_steps": 5, "storage_uri": f"file://{tmp}/ckpt"},
            replica_groups=2,
            **over,
        ),
        strict=False,
    )
