"""The planner prices the fabric: every-step sync where the replicate allreduce is a
small share of the step, DiLoCo every H steps where it is not, with H from the model."""

from __future__ import annotations

import math

import pytest

from stages.errors import ErrorCode, ItoError
from stages.parallelism import Fabric, Plan, PlanRequest, load_fabric, plan, validate_layout
from stages.parallelism.sync import OUTER_STEP_SHARE_OF_ADAMW
from stages.replica_sync import ReplicaSync

# A link slower than any profile: a throttled testbed link, as a benchmark measures it.
THROTTLED = Fabric(
    name="throttled", inter_node_bandwidth_gb_s_per_gpu=0.01, latency_us=2000, efficiency=1.0
)


def _h100(fabric: str | Fabric, **kw: object) -> PlanRequest:
    """llama-1b on two nodes of 8 H100s: the booking the issue's figures are for."""
    return PlanRequest(
        model="llama-1b",
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=2,
        fabric=fabric,
        global_batch_tokens=2**20,
        min_replica_groups=2,
        **kw,  # type: ignore[arg-type]
    )


def _testbed(fabric: str | Fabric, **kw: object) -> PlanRequest:
    """llama-25m on the CPU testbed's two ranks (two replica groups), as tests run it."""
    return PlanRequest(
        model="llama-25m",
        gpu_sku="cpu-testbed",
        gpus_per_node=1,
        node_count=2,
        fabric=fabric,
        global_batch_tokens=8 * 128,
        seq_len=128,
        min_replica_groups=2,
        **kw,  # type: ignore[arg-type]
    )


def _every_step(request: PlanRequest, p: Plan) -> Plan:
    """The same layout pinned to sync every step: its replicate allreduce and step (no
    MFU floor: on a slow fabric that is what makes every-step sync wasteful)."""
    every = request.model_copy(update={"sync": ReplicaSync(), "mfu_floor": 0.0})
    return validate_layout(every, p.layout())


def _needed_h(every: Plan, share: float = 0.1) -> float:
    """H at which DiLoCo's sync and outer step, amortised, are ``share`` of the inner step."""
    st = every.step_time
    inner = st.total - st.replicate_comm
    return (st.replicate_comm + OUTER_STEP_SHARE_OF_ADAMW * st.optimizer) / (share * inner)


@pytest.mark.parametrize(
    ("request_", "mode"),
    [
        (_h100("ib-ndr"), "every_step"),
        (_h100("ethernet"), "diloco"),
        (_testbed("loopback"), "every_step"),
        (_testbed(THROTTLED), "diloco"),
    ],
    ids=["h100-ib-ndr", "h100-ethernet", "testbed-loopback", "testbed-throttled"],
)
def test_the_sync_flips_with_the_fabric(request_: PlanRequest, mode: str) -> None:
    p = plan(request_)
    every = _every_step(request_, p)
    share = every.step_time.replicate_comm / every.step_time_s
    assert p.sync.mode == mode
    # the switch is the named share of the step, nothing else
    assert (share > request_.max_sync_share) == (mode == "diloco")
    assert p.step_time_by_sync["every_step"] == pytest.approx(every.step_time_s, rel=1e-6)
    assert p.step_time_s == p.step_time_by_sync[mode]
    assert p.tokens_per_s == pytest.approx(p.global_batch_tokens / p.step_time_s, rel=1e-5)
    assert any(("DiLoCo every" if mode == "diloco" else "every step") in r for r in p.reasons)


def test_diloco_takes_the_smallest_h_within_the_share() -> None:
    request = _h100("ethernet")
    p = plan(request)
    needed = _needed_h(_every_step(request, p))
    assert 2 < needed < request.max_sync_every
    assert p.sync == ReplicaSync(mode="diloco", sync_every=math.ceil(needed))
    reason = next(r for r in p.reasons if "DiLoCo" in r)
    assert "on ethernet" in reason and f"every {p.sync.sync_every} steps" in reason


def test_h_divides_the_checkpoint_interval_and_phase_ends() -> None:
    request = _h100("ethernet", sync_divides=[1000, 600])  # H must divide 200
    p = plan(request)
    h = p.sync.sync_every
    assert p.sync.mode == "diloco" and 1000 % h == 0 and 600 % h == 0
    needed = _needed_h(_every_step(request, p))
    # the smallest divisor of 200 within the share: no smaller one would do
    assert h >= needed and all(d < needed for d in range(2, h) if 200 % d == 0)


def test_no_h_that_divides_keeps_every_step_and_says_why() -> None:
    p = plan(_testbed(THROTTLED, sync_divides=[35, 12]))  # coprime: only H = 1 divides both
    assert p.sync == ReplicaSync()
    assert any("no DiLoCo interval" in r and "every step" in r for r in p.reasons)


def test_h_is_capped_and_the_cap_is_explained() -> None:
    request = _testbed(THROTTLED, max_sync_every=8)
    p = plan(request)
    assert _needed_h(_every_step(request, p)) > 8
    assert p.sync.sync_every == 8
    assert any("cap of 8 steps" in r for r in p.reasons)


def test_a_short_run_syncs_at_least_min_diloco_syncs_times() -> None:
    """Where the share would want an H near the run's length (the groups train apart
    and meet once or twice), the planner keeps ``min_diloco_syncs`` syncs."""
    request = _testbed(THROTTLED, sync_divides=[60])
    p = plan(request)
    # the share alone would take H = 30 (two syncs), over the 20 three syncs allow
    assert _needed_h(_every_step(request, p)) > 60 // request.min_diloco_syncs
    assert p.sync.mode == "diloco" and p.sync.sync_every == 60 // request.min_diloco_syncs
    assert any("3 syncs in the run" in r for r in p.reasons)
    # a run too short for two syncs of H >= 2 keeps every step, and says why
    short = plan(_testbed(THROTTLED, sync_divides=[5]))
    assert short.sync == ReplicaSync()
    assert any("no DiLoCo interval from 2 to 1" in r for r in short.reasons)


def test_the_diloco_step_time_is_the_formula() -> None:
    # T = (T_every - R) + (R_bw + F x R_lat + T_outer) / H, here pinned with fragments on
    # a high-latency link so the F x R_lat term shows.
    slow = THROTTLED.model_copy(update={"latency_us": 20_000.0})
    pin = ReplicaSync(mode="diloco", sync_every=40, fragments=4)
    request = _testbed(slow, sync=pin)
    p = plan(request)
    every = _every_step(request, p)
    st = every.step_time
    latency = slow.latency_us * 1e-6 * 2 * p.dp_replicate.bit_length()
    outer = OUTER_STEP_SHARE_OF_ADAMW * st.optimizer
    want = st.total - st.replicate_comm + (st.replicate_comm + 3 * latency + outer) / 40
    assert p.sync == pin
    assert p.step_time_s == pytest.approx(want, rel=1e-5)
    assert p.step_time.outer_sync == pytest.approx((want - st.total + st.replicate_comm), rel=1e-5)
    assert p.step_time.replicate_comm == 0
    assert p.step_time.total == pytest.approx(p.step_time_s, rel=1e-6)


def test_a_pinned_diloco_on_a_fast_fabric_is_honoured_and_explained() -> None:
    pin = ReplicaSync(mode="diloco", sync_every=16, fragments=2, outer_lr=0.5)
    p = plan(_h100("ib-ndr", sync=pin))
    assert p.sync == pin
    assert p.step_time_s == p.step_time_by_sync["diloco"]
    assert any("DiLoCo every 16 steps in 2 fragments" in r and "as pinned" in r for r in p.reasons)


def test_a_pinned_every_step_on_a_slow_fabric_is_honoured() -> None:
    p = plan(_h100("ethernet", sync=ReplicaSync()))
    assert p.sync == ReplicaSync()
    assert p.step_time_s == p.step_time_by_sync["every_step"]
    assert p.step_time_by_sync["diloco"] < p.step_time_s  # what DiLoCo would have given
    assert any("every step, as pinned" in r for r in p.reasons)


def test_a_pinned_diloco_gets_two_replica_groups() -> None:
    request = _testbed("loopback", sync=ReplicaSync(mode="diloco", sync_every=4))
    assert plan(request.model_copy(update={"min_replica_groups": 1})).dp_replicate >= 2


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        # H does not divide the checkpoint interval / a phase's end
        (
            _h100("ethernet", sync=ReplicaSync(mode="diloco", sync_every=64), sync_divides=[100]),
            "does not divide step 100",
        ),
        # one GPU: one replica group, nothing to sync with
        (
            _testbed("loopback", sync=ReplicaSync(mode="diloco", sync_every=4)).model_copy(
                update={"node_count": 1, "min_replica_groups": 1}
            ),
            "one group",
        ),
    ],
    ids=["h-not-dividing", "one-gpu"],
)
def test_an_incoherent_pin_is_plan_sync_invalid(request_: PlanRequest, words: str) -> None:
    with pytest.raises(ItoError) as err:
        plan(request_)
    assert err.value.code == ErrorCode.plan_sync_invalid and words in err.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"mode": "every_step", "sync_every": 8},
        {"mode": "every_step", "fragments": 2},
        {"mode": "diloco", "sync_every": 1},
        {"mode": "diloco", "sync_every": 10, "fragments": 4},
    ],
)
def test_an_incoherent_pin_never_reaches_the_planner(fields: dict[str, object]) -> None:
    with pytest.raises(ItoError) as err:
        ReplicaSync(**fields)  # type: ignore[arg-type]
    assert err.value.code == ErrorCode.plan_sync_invalid


def test_a_fabric_object_plans_like_its_profile() -> None:
    ethernet = load_fabric("ethernet")
    by_object = plan(_h100(ethernet.model_copy(update={"name": "measured"})))
    by_name = plan(_h100("ethernet"))
    assert by_object.fabric == "measured"
    assert by_object.sync == by_name.sync and by_object.step_time_s == by_name.step_time_s


def test_a_run_with_few_syncs_averages_the_groups_and_a_long_one_takes_outer_momentum() -> None:
    short = plan(_testbed(THROTTLED, sync_divides=[60]))
    assert short.sync.mode == "diloco" and 60 // short.sync.sync_every < 50
    assert (short.sync.outer_lr, short.sync.outer_momentum) == (1.0, 0.0)
    assert any("weights averaged" in r for r in short.reasons)
    long = plan(_testbed(THROTTLED, sync_divides=[200_000]))
    assert long.sync.mode == "diloco"
    assert (long.sync.outer_lr, long.sync.outer_momentum) == (0.7, 0.9)  # the paper's
    assert not any("weights averaged" in r for r in long.reasons)
