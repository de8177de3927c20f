"""The planner's work is bounded whatever the request's magnitudes."""

from __future__ import annotations

import threading

import pytest

from stages.errors import ErrorCode, ItoError
from stages.parallelism import ParallelismConfig, PlanRequest, plan
from stages.parallelism.candidates import divisors


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 1024, 720720, 2**30, 2**31 - 1])
def test_divisors_are_exact(n: int) -> None:
    got = divisors(n)
    assert got == sorted(got) and len(set(got)) == len(got)
    assert all(n % d == 0 for d in got) and got[0] == 1 and got[-1] == n
    if n <= 720720:
        assert got == [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_of_a_huge_number_finish() -> None:
    """The old linear search never returned for 6.4e29 / seq_len; this is O(sqrt n)."""
    done = threading.Event()
    result: list[list[int]] = []

    def work() -> None:
        result.append(divisors(2**40))
        done.set()

    threading.Thread(target=work, daemon=True).start()
    assert done.wait(timeout=60), "divisor search did not finish"
    assert len(result[0]) == 41


def test_a_search_over_its_time_budget_is_refused_with_its_code() -> None:
    request = PlanRequest(
        model="llama3-405b",
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=64,
        fabric="ib-ndr",
        global_batch_tokens=16 * 2**20,
        seq_len=8192,
    )
    with pytest.raises(ItoError) as e:
        plan(request, time_budget_s=1e-9)
    assert e.value.code == ErrorCode.plan_time_budget_exceeded
    assert plan(request, time_budget_s=120).step_time_s > 0  # a real budget still plans


def test_batch_and_steps_beyond_any_real_run_fail_the_schema() -> None:
    from pydantic import ValidationError

    from stages.trainer.config import TrainingTarget

    with pytest.raises(ValidationError):
        ParallelismConfig(model="llama3-8b", global_batch_tokens=int(6.4e29))
    with pytest.raises(ValidationError):
        TrainingTarget(max_steps=10, seq_len=64, global_batch_tokens=int(6.4e29))
    with pytest.raises(ValidationError):
        TrainingTarget(max_steps=10**12, seq_len=64, global_batch_tokens=512)
