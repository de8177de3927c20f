"""Runs land on their booking's nodes: one Ray cluster on this machine (an unmarked
head with no CPUs, and two raylets marked ``booking:bk-a`` and ``booking:bk-b``; the
head is the one test_booking_resize_on_ray.py goes on to use, helpers.raynodes), an
API server joined to it with ``--ray-address``.

Two runs at once, one per booking, and Ray's state API shows every actor of each run
on its own booking's node; a run for a booking with no node waits in ``starting``
with a reason and fails with ``booking_nodes_unavailable``; stopping bk-a's raylet
under a run is recorded as a ``node_lost`` interruption. Only the GPUs are absent
(each "GPU" is a cpu-testbed rank): every raylet, actor and kill here is real.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.backend import Backend
from helpers.flows import submit_run
from helpers.manifests import cpu_testbed_manifest, data_ref
from helpers.raynodes import booking_raylets, booking_raylets_group, server_on_cluster
from helpers.runs import api_data, wait_run
from helpers.tenants import Tenant, cpu_booking_doc

from orchestrator.db.store import Store

pytestmark = [pytest.mark.slow, booking_raylets_group]

WAIT_S = float(os.environ.get("ITO_TEST_WAIT_S", "240"))
# Operator setting under test: how long a run waits for its booking's nodes.
PLACEMENT_WAIT_S = 6.0


@pytest.fixture(scope="module")
def env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("placement")
    raylets = {"bk-a": {"booking:bk-a": 1.0}, "bk-b": {"booking:bk-b": 1.0}}
    with (
        booking_raylets(request, tmp_path_factory, raylets) as (cluster, nodes),
        server_on_cluster(
            tmp,
            cluster,
            [cpu_booking_doc(bid, "acme", gpus=1) for bid in ("bk-a", "bk-b", "bk-none")],
            {
                "ITO_TRAIN_OVERRIDES": json.dumps({"pace_step_s": 0.25}),
                "ITO_PLACEMENT_WAIT_S": str(PLACEMENT_WAIT_S),
            },
        ) as (be, tenant, corpus),
    ):
        yield {
            "backend": be,
            "tenant": tenant,
            "tmp": tmp,
            "cluster": cluster,
            "nodes": nodes,
            "corpus": corpus,
        }


def _submit(env: dict[str, Any], booking: str, steps: int) -> str:
    be: Backend = env["backend"]
    t: Tenant = env["tenant"]
    m = cpu_testbed_manifest(
        [data_ref(env["corpus"], license="PSF")], env["tmp"] / "ckpt", steps=steps
    )
    with be.client() as c:
        return submit_run(c, t, booking, m)


def _run(env: dict[str, Any], run_id: str) -> dict[str, Any]:
    return api_data(env["backend"], env["tenant"].submitter, f"/v1/runs/{run_id}")


def _wait(
    env: dict[str, Any], run_id: str, pred: Any, what: str, timeout_s: float = WAIT_S
) -> dict[str, Any]:
    return wait_run(env["backend"], env["tenant"].submitter, run_id, pred, what, timeout_s)


def _actors_by_node(env: dict[str, Any]) -> tuple[dict[str, str], list[Any]]:
    """node id -> its booking mark (or "" for the head), and the live actors."""
    from ray.util.state import list_actors, list_nodes

    os.environ["RAY_AUTH_MODE"] = "token"
    address = env["cluster"].dashboard
    marks = {
        n.node_id: next((k for k in n.resources_total if k.startswith("booking:")), "")
        for n in list_nodes(address=address, detail=True)
    }
    actors = list_actors(
        address=address, filters=[("state", "=", "ALIVE")], limit=10_000, detail=True
    )
    return marks, actors


def _events(env: dict[str, Any], run_id: str, kind: str) -> list[dict[str, Any]]:
    store = Store(env["backend"].db)
    try:
        return [dict(e["payload"]) for e in store.list_events(run_id, kinds=[kind])]
    finally:
        store.close()


def test_two_runs_at_once_each_only_on_its_booking_node(env: dict[str, Any]) -> None:
    runs = {"bk-a": _submit(env, "bk-a", steps=40), "bk-b": _submit(env, "bk-b", steps=40)}
    deadline = time.monotonic() + WAIT_S
    seen: dict[str, set[str]] = {}
    # Sample until both runs have their driver, lighthouse and trainer live at once.
    while time.monotonic() < deadline:
        marks, actors = _actors_by_node(env)
        seen = {
            b: {a.name for a in actors if a.name and a.name.startswith(f"run-{r}")}
            for b, r in runs.items()
        }
        if all(
            any("-trainer-" in n for n in names) and any(n.endswith("-lighthouse") for n in names)
            for names in seen.values()
        ):
            break
        for r in runs.values():
            assert _run(env, r)["state"] in ("accepted", "starting", "running"), _run(env, r)
        time.sleep(0.5)
    else:
        from ray.util.state import list_actors

        every = list_actors(address=env["cluster"].dashboard, limit=10_000, detail=True)
        raise AssertionError(
            f"the two runs were never live together: {seen}\n"
            f"{[(a.name, a.state, a.death_cause) for a in every]}\n"
            f"{[_run(env, r) for r in runs.values()]}\n"
            f"{env['backend'].log_text()[-3000:]}"
        )
    for booking, run_id in runs.items():
        mine = [a for a in actors if a.name and a.name.startswith(f"run-{run_id}")]
        assert {f"run-{run_id}", f"run-{run_id}-lighthouse"} <= {a.name for a in mine}
        for a in mine:
            assert marks[a.node_id] == f"booking:{booking}", (a.name, marks[a.node_id])
            assert a.placement_group_id, f"{a.name} is not in the run's placement group"
        assert len({a.placement_group_id for a in mine}) == 1
    for run_id in runs.values():
        run = _wait(env, run_id, lambda r: r["state"] in ("succeeded", "failed"), "the end")
        assert run["state"] == "succeeded", run
    # The reservation goes with the run.
    from ray.util.state import list_placement_groups

    groups = {g.name: g.state for g in list_placement_groups(address=env["cluster"].dashboard)}
    for run_id in runs.values():
        assert groups.get(f"run-{run_id}-pg") in (None, "REMOVED"), groups


def test_booking_without_a_node_waits_then_fails_with_its_code(env: dict[str, Any]) -> None:
    run_id = _submit(env, "bk-none", steps=5)
    waiting = _wait(
        env,
        run_id,
        lambda r: (
            r["state"] == "starting"
            and "no live node is marked booking:bk-none" in (r.get("state_reason") or "")
        ),
        "starting with a reason",
        timeout_s=60,
    )
    assert waiting["state"] == "starting"
    failed = _wait(
        env, run_id, lambda r: r["state"] == "failed", "failed", timeout_s=PLACEMENT_WAIT_S + 60
    )
    assert failed["state_reason"].startswith("booking_nodes_unavailable:"), failed
    assert not _events(env, run_id, "step")  # nothing ran anywhere


def test_a_booking_node_leaving_mid_run_is_an_interruption(env: dict[str, Any]) -> None:
    run_id = _submit(env, "bk-a", steps=400)
    _wait(
        env,
        run_id,
        lambda r: r["state"] == "running" and _events(env, run_id, "step"),
        "a committed step",
    )
    env["nodes"]["bk-a"].stop()
    failed = _wait(
        env, run_id, lambda r: r["state"] == "failed", "failed", timeout_s=PLACEMENT_WAIT_S + 90
    )
    lost = _events(env, run_id, "interruption")
    assert any(e["interruption_kind"] == "node_lost" for e in lost), lost
    # It waited for the node to come back, bounded, then said which code.
    assert failed["state_reason"].startswith("booking_nodes_unavailable:"), failed
