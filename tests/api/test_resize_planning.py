"""The planner's replica-group count of a running run after its booking changed
(``gates.planning.resize_groups``): the layout inside each group as planned, whole
groups only, the fixed global batch split evenly, and its refusals."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.resizing import PLAN

from orchestrator.gates.planning import MAX_REPLICA_GROUPS, resize_groups
from stages.errors import ErrorCode, ItoError


def _plan(**over: Any) -> dict[str, Any]:
    """The shared stored plan (4 groups x 4 ranks on 2 nodes x 8 GPUs, 48 sequences)."""
    return {**PLAN, **over}


def _booking(nodes: int, gpus_per_node: int = 8) -> dict[str, Any]:
    return {"gpus_per_node": gpus_per_node, "node_count": nodes}


def test_whole_groups_of_the_planned_layout_follow_the_booking() -> None:
    grown = resize_groups(_plan(), _booking(3), current_groups=4, grew=True)
    assert (grown.replica_groups, grown.ranks_per_group) == (6, 4)
    assert "24 GPUs hold 6 whole group(s) of 4 ranks" in grown.reason
    shrunk = resize_groups(_plan(), _booking(1), current_groups=4, grew=False)
    assert shrunk.replica_groups == 2
    # A partial group's GPUs stay unused: 12 GPUs hold 3 groups of 4.
    assert resize_groups(_plan(), _booking(3, 4), current_groups=4, grew=False).replica_groups == 3


def test_a_group_count_the_batch_does_not_split_over_is_skipped_for_a_smaller_one() -> None:
    # 5 nodes hold 10 groups, but 48 sequences split over 10 x 2 ranks unevenly: 8 do.
    count = resize_groups(_plan(), _booking(5), current_groups=4, grew=True)
    assert count.replica_groups == 8 and "8 split the global batch" in count.reason
    # Gradient accumulation is part of the split: 48 / (6 x 2) = 4 sequences per rank
    # do not make 3 accumulation steps, 48 / (4 x 2) = 6 do.
    accum = _plan(grad_accum=3)
    assert resize_groups(accum, _booking(3), current_groups=2, grew=True).replica_groups == 4


def test_less_than_one_group_pauses_the_run() -> None:
    count = resize_groups(
        _plan(tp=8, dp_shard=2, dp_replicate=1), _booking(1), current_groups=1, grew=False
    )
    assert count.replica_groups == 0 and "pauses" in count.reason
    assert resize_groups(_plan(), _booking(0), current_groups=4, grew=False).replica_groups == 0


def test_growth_that_gives_no_group_more_is_refused_with_its_code() -> None:
    # Groups of 16 ranks on 8-GPU nodes: a third node holds no second group.
    wide = _plan(tp=8, dp_shard=2, dp_replicate=1)
    with pytest.raises(ItoError) as e:
        resize_groups(wide, _booking(3), current_groups=1, grew=True)
    assert e.value.code == ErrorCode.plan_resize_no_group
    # 5 groups fit, but 48 sequences do not split over 5 groups x 2 ranks.
    with pytest.raises(ItoError) as e:
        resize_groups(
            _plan(dp_replicate=4, tp=1, dp_shard=2), _booking(1, 10), current_groups=4, grew=True
        )
    assert e.value.code == ErrorCode.plan_resize_batch_not_divisible
    # The same count after a shrink is not refused: the lost nodes are gone.
    assert resize_groups(wide, _booking(2), current_groups=1, grew=False).replica_groups == 1


def test_the_group_count_is_capped_and_never_below_one_sequence_per_rank() -> None:
    one_rank = _plan(tp=1, dp_shard=1, dp_replicate=2, global_batch_tokens=1024 * 256)
    big = resize_groups(one_rank, _booking(100), current_groups=2, grew=True)
    assert big.replica_groups == MAX_REPLICA_GROUPS
    few = _plan(tp=1, dp_shard=1, dp_replicate=2, global_batch_tokens=6 * 256)
    assert resize_groups(few, _booking(2), current_groups=2, grew=True).replica_groups == 6
