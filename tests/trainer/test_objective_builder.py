"""A post-training objective reaches the engine by name (``ObjectiveConfig.builder``):
the name post-training gives is its builder, and a config names one exactly for the
post-training objectives, inside stages/."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stages.post_training.config import OBJECTIVE_BUILDER
from stages.trainer.config import ObjectiveConfig
from stages.trainer.rank.objective import named_builder


def test_post_trainings_name_is_its_builder() -> None:
    from stages.post_training.objectives import build_objective

    assert named_builder(OBJECTIVE_BUILDER) is build_objective


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"kind": "sft", "data_path": "rows.jsonl"}, "builder is set exactly"),
        ({"kind": "lm", "builder": OBJECTIVE_BUILDER}, "builder is set exactly"),
        ({"kind": "sft", "data_path": "r", "builder": "os:system"}, "pattern"),
        ({"kind": "sft", "data_path": "r", "builder": "stages.x:y; import os"}, "pattern"),
    ],
)
def test_a_builder_is_named_exactly_where_one_is_built(
    fields: dict[str, str], refused: str
) -> None:
    with pytest.raises(ValidationError, match=refused):
        ObjectiveConfig.model_validate(fields)
    ok = ObjectiveConfig(kind="sft", data_path="rows.jsonl", builder=OBJECTIVE_BUILDER)
    assert ok.builder == OBJECTIVE_BUILDER
