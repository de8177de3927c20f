"""A device as measured: the planner prices a SKU whose rates a benchmark (or an
operator) measured, the way it prices a link it measured, and its sync choice follows."""

from __future__ import annotations

import pytest

from stages.parallelism import Fabric, PlanRequest, plan
from stages.parallelism.hardware import load_gpu_sku, measured_sku

# About the slow-fabric benchmark's link (a 100 Mbit/s veth pair).
LINK = Fabric(
    name="measured-link", inter_node_bandwidth_gb_s_per_gpu=0.012, latency_us=10, efficiency=1.0
)


def _one_device(sku: object) -> PlanRequest:
    """One group's share of the slow-fabric benchmark's batch on one device alone."""
    return PlanRequest(
        model="llama-small",
        gpu_sku=sku,  # type: ignore[arg-type]
        gpus_per_node=1,
        node_count=1,
        fabric="loopback",
        global_batch_tokens=2048,
        seq_len=64,
    )


def _two_groups(sku: object, fabric: str | Fabric) -> PlanRequest:
    return PlanRequest(
        model="llama-small",
        gpu_sku=sku,  # type: ignore[arg-type]
        gpus_per_node=1,
        node_count=2,
        fabric=fabric,
        global_batch_tokens=4096,
        seq_len=64,
        min_replica_groups=2,
        sync_divides=[60],
    )


@pytest.mark.parametrize("speedup", [0.5, 3.0, 10.0])
def test_the_measured_step_is_the_predicted_one(speedup: float) -> None:
    testbed = load_gpu_sku("cpu-testbed")
    catalogue = plan(_one_device("cpu-testbed")).step_time_s
    measured = catalogue / speedup
    sku = measured_sku(testbed, catalogue, measured)
    assert plan(_one_device(sku)).step_time_s == pytest.approx(measured, rel=0.01)
    # what the SKU is stays: its name, memory and links; only its rates change
    assert (sku.name, sku.memory_gib, sku.intra_node_bandwidth_gb_s) == (
        testbed.name,
        testbed.memory_gib,
        testbed.intra_node_bandwidth_gb_s,
    )
    assert sku.bf16_tflops == pytest.approx(testbed.bf16_tflops * speedup)
    assert sku.hbm_bandwidth_gb_s == pytest.approx(testbed.hbm_bandwidth_gb_s * speedup)


def test_an_fp8_rate_scales_with_the_rest() -> None:
    h100 = load_gpu_sku("H100-SXM")
    sku = measured_sku(h100, 2.0, 1.0)
    assert h100.fp8_tflops is not None and sku.fp8_tflops == pytest.approx(2 * h100.fp8_tflops)
    assert sku.trains_fp8  # still an H100: what it may train in is the SKU's


def test_the_sync_follows_the_measured_device_over_the_same_link() -> None:
    """The link's allreduce is fixed; a device that computes faster makes it a larger
    share of the step: a slow one keeps every step, faster ones need DiLoCo with longer
    intervals to amortise the same sync."""
    testbed = load_gpu_sku("cpu-testbed")
    catalogue = plan(_one_device("cpu-testbed")).step_time_s
    plans = [
        plan(_two_groups(measured_sku(testbed, catalogue, catalogue * f), LINK))
        for f in (2.0, 1.0, 0.2)
    ]
    assert [p.sync.mode for p in plans] == ["every_step", "diloco", "diloco"]
    assert plans[1].sync.sync_every < plans[2].sync.sync_every
    # the predicted every-step time is the measured compute plus the same allreduce
    every = [p.step_time_by_sync["every_step"] for p in plans]
    assert every[0] > every[1] > every[2]
    # on loopback all keep every step: the link, not the device, makes the choice
    for f in (2.0, 1.0, 0.2):
        sku = measured_sku(testbed, catalogue, catalogue * f)
        assert plan(_two_groups(sku, "loopback")).sync.every_step


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError):
        measured_sku(load_gpu_sku("cpu-testbed"), 1.0, 0.0)
