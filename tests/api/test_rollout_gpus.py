"""RLVR's rollout workers generate on GPUs of their own: on a GPU booking the trainer
is planned on the GPUs they leave on each node, a resize keeps them out of the
trainer's count, a recipe that would leave the trainer none is refused at submit with
its code, and the run's device follows its reservation. GPUs are modelled from
configs/ (none is needed); the CPU testbed keeps every rank."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.manifests import example_manifest, gsm8k_ref
from helpers.resizing import PLAN

from orchestrator.gates.manifest import Manifest
from orchestrator.gates.planning import plan_manifest, resize_groups
from stages.run_facts import PlacementFact

from .conftest import Api, code_of

LLAMA_1B = {
    "model": {"preset": "llama-1b", "architecture": "llama", "size": "1B", "revision": "r"},
    "training": {
        "max_steps": 50,
        "seq_len": 4096,
        "global_batch_tokens": 1 << 20,
        "learning_rate": 1e-3,
        "warmup_steps": 5,
        "seed": 0,
    },
}


def _h100(nodes: int) -> dict[str, Any]:
    return {"gpu_sku": "H100-SXM", "gpus_per_node": 8, "node_count": nodes, "fabric": "ib-ndr"}


def _manifest(workers: int | None, **over: Any) -> Manifest:
    ref = example_manifest()["data"]["refs"][0]
    rlvr = {"data": ref, "steps": 10, "rollout_workers": workers}
    post = {} if workers is None else {"rlvr": rlvr}
    return Manifest.model_validate(example_manifest(post_training=post, **over))


def _plan(m: Manifest, booking: dict[str, Any]) -> dict[str, Any]:
    result = plan_manifest(m, booking)
    assert result.refusal is None and result.plan is not None, result.refusal
    return result.plan


@pytest.mark.parametrize(
    ("nodes", "workers", "held"),
    [(1, 4, 4), (2, 7, 4), (2, 8, 4)],
)
def test_the_trainer_is_planned_on_the_gpus_the_rollout_workers_leave_on_each_node(
    nodes: int, workers: int, held: int
) -> None:
    alone = _plan(_manifest(None, **LLAMA_1B), _h100(nodes))
    assert (alone["world_size"], alone["rollout_gpus_per_node"]) == (8 * nodes, 0)
    plan = _plan(_manifest(workers, **LLAMA_1B), _h100(nodes))
    assert plan["rollout_gpus_per_node"] == held
    assert plan["gpus_per_node"] == 8 - held and plan["world_size"] == (8 - held) * nodes
    ranks = plan["tp"] * plan["pp"] * plan["cp"] * plan["dp_shard"] * plan["dp_replicate"]
    # The ranks take a GPU each, spread evenly over the nodes; the workers the rest.
    assert ranks == plan["world_size"] and held * nodes >= workers


def test_a_world_the_rollout_workers_leave_unplannable_is_refused_naming_them() -> None:
    # 2 workers on one node of 8: the trainer's 6 ranks do not divide 256 sequences.
    result = plan_manifest(_manifest(2, **LLAMA_1B), _h100(1))
    assert result.plan is None and result.refusal is not None
    assert result.refusal["code"] == "plan_batch_not_divisible"
    assert result.refusal["message"].startswith(
        "no layout of 6 x H100-SXM (the trainer's 6 of each node's 8 GPUs: 2 kept for "
        "RLVR's rollout workers) fits llama-1b"
    )
    alone = plan_manifest(_manifest(None, **LLAMA_1B), _h100(1))
    assert alone.refusal is None


def test_the_cpu_testbed_keeps_every_rank_beside_its_rollout_workers() -> None:
    booking = {"gpu_sku": "cpu-testbed", "gpus_per_node": 2, "node_count": 1, "fabric": "loopback"}
    plan = _plan(_manifest(2), booking)
    assert (plan["world_size"], plan["rollout_gpus_per_node"]) == (2, 0)


def test_a_resize_counts_only_the_trainers_gpus_of_each_node() -> None:
    # The resize tests' plan (groups of 4 ranks on 2 nodes x 8 GPUs), with 4 GPUs a node
    # held by rollout workers: 8 trainer GPUs, 2 groups.
    plan = {**PLAN, "gpus_per_node": 4, "dp_replicate": 2, "rollout_gpus_per_node": 4}
    grown = resize_groups(plan, _h100(3), current_groups=2, grew=True)
    assert grown.replica_groups == 3 and "12 GPUs hold 3 whole group(s)" in grown.reason
    assert resize_groups(plan, _h100(2), current_groups=3, grew=False).replica_groups == 2


def test_rollout_workers_that_leave_the_trainer_no_gpu_are_refused_at_submit(api: Api) -> None:
    def recipe(workers: int) -> dict[str, Any]:
        rlvr = {"data": gsm8k_ref(api.tmp), "steps": 10, "rollout_workers": workers}
        return api.manifest(post_training={"rlvr": rlvr})

    # The fixture's booking: one node of 8 H100s.
    refused = recipe(8)
    r = api.submit(manifest=refused, ref=api.ref(manifest=refused, cost_usd=10**6))
    assert r.status_code == 422 and code_of(r) == "rollout_gpus_insufficient", r.json()
    assert "leave the trainer none" in r.json()["error"]["message"]
    result = plan_manifest(Manifest.model_validate(refused), _h100(1))
    assert result.refusal is not None and result.refusal["code"] == "rollout_gpus_insufficient"
    assert api.store.read("SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0
    fits = recipe(7)
    api.run(manifest=fits, ref=api.ref(manifest=fits, cost_usd=10**6), idem="key-rollout-7")


def test_the_runs_device_is_cuda_where_its_reservation_holds_the_nodes_gpus() -> None:
    def fact(bundle: dict[str, float]) -> PlacementFact:
        return PlacementFact(
            booking_id="bk",
            resource="booking:bk",
            placement_group="run-r-pg",
            placement_group_id="ab" * 18,
            bundles=1,
            bundle=bundle,
        )

    assert fact({"booking:bk": 8.0, "CPU": 96.0, "GPU": 8.0}).device == "cuda"
    # The testbed and the embedded head reserve no GPU: their ranks are CPU processes.
    assert fact({"booking:bk": 2.0, "CPU": 2.0}).device == "cpu"
