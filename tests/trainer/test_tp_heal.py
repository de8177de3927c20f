"""A warm standby group takes the place of a tensor-parallel replica group that lost
a rank, torchft heals it from the peer group with the same layout (no checkpoint
read), and the stage reports the layout the workers built.

Real Ray actors (2 replica groups x 2 TP ranks, a standby group of 2 ranks), torchft's
lighthouse and Managers, gloo, DTensor TP, and a SIGKILL of one rank of group 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.checkpointing.storage import read_log
from stages.events import CheckpointEvent, FleetEvent, InterruptionEvent, StepEvent
from stages.trainer.parallel.layout import ParallelLayout
from tests.trainer.test_ft_recovery import Run, _config

# A TP=2 heal on gloo takes ~260 s on a loaded 2-core box: past the default 300 s bound.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_standby_group_takes_a_tp2_groups_place_and_both_end_equal(
    ray_local: None, tmp_path: Path
) -> None:
    from stages.trainer import kill_replica_group
    from stages.trainer.config import TrainingTarget

    # The survivor must still be training when the standby group joins, or there is
    # nobody to heal from: while group 1 is missing the survivor steps at 0.5 s, so the
    # run outlasts the heal however slow the host, and ends soon after the rejoin.
    plan = ParallelLayout(tp=2, dp_shard=1)
    cfg = _config(
        tmp_path,
        ranks_per_group=2,
        parallel=plan,
        worker_num_cpus=0.25,
        target=TrainingTarget(max_steps=80, seq_len=32, global_batch_tokens=256, warmup_steps=5),
        degraded_pace_step_s=0.5,
    )
    assert cfg.spare_groups == 1  # the production default: one standby group per node
    with Run(cfg, tmp_path, "tpheal") as run:
        run.wait_for(
            lambda e: (
                isinstance(e, StepEvent) and e.committed and e.step >= 10 and e.quorum_size == 2
            ),
            "10 steps in the full quorum",
        )
        run.wait_for(lambda e: isinstance(e, CheckpointEvent), "a checkpoint to reload from")
        warm = [
            run.wait_for(
                lambda e, r=r: (
                    isinstance(e, FleetEvent)
                    and e.action == "standby_warm"
                    and e.actors == [_standby(r)]
                ),
                f"standby rank {r} warm",
            )
            for r in range(2)
        ]
        assert len(warm) == 2
        # One rank dies; its group is one failure unit.
        killed_at, pids = kill_replica_group("tpheal", 1, ranks=[1])
        assert len(pids) == 1
        took = run.wait_for(
            lambda e: (
                isinstance(e, FleetEvent)
                and e.action == "standby_activated"
                and e.replica_group == 1
            ),
            "the standby group takes group 1's place",
        )
        assert took.ts > killed_at and took.actors == [_standby(r) for r in range(2)]
        # Emitted once group 1 healed from its live peer and trains again.
        healed = run.wait_for(
            lambda e: (
                isinstance(e, InterruptionEvent)
                and e.interruption_kind == "replica_group_lost"
                and e.replica_group == 1
                and e.recovered_at is not None
            ),
            "recovery",
        )
        out = run.join()
    assert out.status == "passed", out.reason
    assert healed.detected_at >= killed_at - 1.0
    after = [e for e in run.steps(1) if e.committed and e.ts > healed.recovered_at]
    assert any(e.quorum_size == 2 for e in after), "group 1 never rejoined the full quorum"
    # Healed from the peer: the storage recorded no checkpoint read after the kill.
    assert not [r for r in read_log(out.artifacts["checkpoint_dir"]) if r.at > killed_at]
    # Each TP rank's shard is identical across the two groups after the heal.
    digests = out.artifacts["rank_digests"]
    assert set(digests) == {"0/0", "0/1", "1/0", "1/1"}
    assert digests["0/0"] == digests["1/0"] and digests["0/1"] == digests["1/1"]
    assert digests["0/0"] != digests["0/1"]  # the two ranks hold different shards
    # stage_gates carry the layout read back from the workers' mesh: the plan's.
    built = out.artifacts["layout"]
    assert {k: built[k] for k in ("pp", "dp_shard", "cp", "tp")} == plan.resolved(2).degrees()
    assert built["precision"] == "fp32" and built["activation_checkpointing"] == "none"
    assert out.metrics["layout_tp"] == 2.0 and out.metrics["layout_dp_shard"] == 1.0


def _standby(rank: int) -> str:
    from stages.trainer.rank.replica import spare_name

    return spare_name("tpheal", 0, rank)
