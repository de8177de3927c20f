"""DiLoCo across replica groups whose ranks split the model (TP, PP): each rank syncs
its own shard or stage with the same rank of the other groups."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers.stage_run import StageRun
from test_diloco import JOIN_TIMEOUT_S, SYNC_EVERY, WAIT_S, _config, _shares

from stages.trainer.config import TrainingTarget
from stages.trainer.parallel.layout import ParallelLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=2), ParallelLayout(pp=2, pp_microbatches=2)], ids=["tp2", "pp2"]
)
def test_groups_of_two_ranks_sync_in_turns(
    ray_local: None, tmp_path: Path, layout: ParallelLayout
) -> None:
    steps = 2 * SYNC_EVERY
    cfg = _config(
        tmp_path,
        ranks_per_group=2,
        parallel=layout,
        worker_num_cpus=0.25,
        target=TrainingTarget(max_steps=steps, seq_len=32, global_batch_tokens=256, warmup_steps=2),
    )
    with StageRun(cfg, tmp_path, "dllayout", wait_s=WAIT_S, join_timeout_s=JOIN_TIMEOUT_S) as run:
        out = run.join()
    assert out.status == "passed", out.reason
    assert _shares(run) == Counter({(s, place): 1 for s in range(1, steps + 1) for place in (0, 1)})
    # Each rank's shard or stage ends equal to the same rank's of the other group, and
    # the group's two ranks hold different ones.
    digests = out.artifacts["rank_digests"]
    assert set(digests) == {"0/0", "0/1", "1/0", "1/1"}
    assert digests["0/0"] == digests["1/0"] != digests["0/1"] == digests["1/1"]
