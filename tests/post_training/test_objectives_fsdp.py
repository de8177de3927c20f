"""SFT and DPO on one group of two FSDP ranks make the update of one rank with the
whole batch, as GRPO's do (test_grpo_engine.py): real local Ray, torchft, gloo, FSDP2.

Each FSDP rank trains its slice of the global batch (data-parallel index = group x
dp_shard + its dp_shard coordinate), divides its loss by its share of the global
batch's count, and FSDP's reduce-scatter averages the gradients over the ranks. A
layout that fed both ranks the same rows, or weighed them by a per-rank count, still
trains and "improves" (test_sharded_objectives.py): only the comparison with one rank
sees it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.objective_runs import (
    LR,
    STEPS,
    ReferenceRun,
    final_weights,
    objective_config,
    sft_rows,
    train_on_engine,
)

from stages.events import StepEvent
from stages.post_training.config import OBJECTIVE_BUILDER
from stages.trainer.config import ObjectiveConfig

pytestmark = pytest.mark.slow

FSDP2 = {"ranks_per_group": 2, "parallel": {"dp_shard": 2}, "worker_num_cpus": 0.5}


def _one_rank(tmp: Path, policy: Path, data: Path, objective: ObjectiveConfig) -> ReferenceRun:
    one = objective_config(tmp, policy, data, groups=1, objective=objective)
    r1, ev1 = train_on_engine(one, tmp, f"{objective.kind}-one")
    assert r1.final_checkpoint
    return ReferenceRun(one, r1, ev1, final_weights(one, r1.final_checkpoint))


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_two_fsdp_ranks_make_the_update_of_one_rank(
    kind: str,
    sft_one_rank: ReferenceRun,
    tiny_policy: Path,
    task_files: dict[str, Path],
    tmp_path: Path,
) -> None:
    from stages.post_training.hf_io import load_model

    data = sft_rows(tmp_path / "sft.jsonl") if kind == "sft" else task_files["dpo"]
    objective = ObjectiveConfig(
        kind=kind,  # type: ignore[arg-type]
        builder=OBJECTIVE_BUILDER,
        data_path=str(data),
        batch_size=4,
        max_length=64,
        **({"beta": 0.3} if kind == "dpo" else {}),  # sft has none
    )
    fsdp = objective_config(
        tmp_path / "fsdp2", tiny_policy, data, groups=1, objective=objective, **FSDP2
    )
    rf, evf = train_on_engine(fsdp, tmp_path / "fsdp2", f"{kind}-fsdp2")
    if kind == "sft":  # the session's SFT run on one rank (the two-group test's too)
        one = sft_one_rank
        one.assert_trains_the_same(fsdp)
    else:
        one = _one_rank(tmp_path / "one", tiny_policy, data, objective)
    r1, ev1 = one.result, one.events
    assert fsdp.micro_batch == 2 and one.cfg.micro_batch == 4  # the same global batch
    assert rf.steps == r1.steps == STEPS
    # The reported loss is the global batch's (mean target NLL, mean pair loss) in both.
    stepsf = [e for e in evf if isinstance(e, StepEvent) and e.committed]
    steps1 = [e for e in ev1 if isinstance(e, StepEvent) and e.committed]
    for a, b in zip(stepsf, steps1, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)

    assert rf.final_checkpoint and r1.final_checkpoint
    wf, w1 = final_weights(fsdp, rf.final_checkpoint), one.weights
    w0 = load_model(tiny_policy).state_dict()
    update = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
    diff = max(float((wf[k] - w1[k]).abs().max()) for k in w1)
    # Tolerance as for two groups (test_objective_engine.py): the same per-token terms
    # summed in another order, passed on by AdamW, ~1e-5 of the update; the wrong rows
    # on a rank, or a per-rank mean, move it by percents.
    print(f"{kind} fsdp2 vs one rank: max weight diff {diff:.3g}, max update {update:.3g}")
    assert update > 0.5 * LR  # AdamW moves a weight by ~LR a step
    assert diff <= 1e-3 * update, (diff, update)
