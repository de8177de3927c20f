"""A run follows its booking through the product: one Ray cluster on this machine (an
unmarked head with no CPUs, the one test_booking_placement_on_ray.py used before,
helpers.raynodes; three raylets marked ``booking:bk-grow``, each started with its
booking node's name, ``booking-node:bk-grow-n<i>``, as deploy/slurm and deploy/k8s
start them), an API server joined to it with ``--ray-address``.

A node taken back drains the groups on it: a run on the booking's two nodes loses
``bk-grow-n0``, the node of its group 0, and group 0 leaves (not group 1, the highest,
which the trainer drains when it does not know the nodes).

The run is planned on the booking's 2 nodes (2 replica groups of 1 rank); mid-run the
operator adds the third node (``ito-backend bookings add-nodes``): the supervisor
reserves it (``run-<id>-pg-c<change>``) and the run grows to 3 groups, the new one on
that node, healed from a live peer; then ``remove-nodes`` takes it back and the run
shrinks to 2. The run's persisted step events are its token ledger: every step's
global batch went out in exactly one share per member group. Its final loss is that
of a run of the same manifest that never resized. Only the GPUs are absent (each
"GPU" is a cpu-testbed rank): every raylet, actor, lighthouse and heal is real.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.backend import Backend
from helpers.flows import submit_run
from helpers.manifests import cpu_testbed_manifest, data_ref
from helpers.raynodes import booking_raylets, booking_raylets_group, server_on_cluster
from helpers.runs import wait_run
from helpers.tenants import Tenant, admin, cpu_booking_doc
from helpers.waiting import wait_until

from orchestrator.db.store import Store
from stages.event_buffer import expand_steps
from stages.placement import node_resource

pytestmark = [pytest.mark.slow, booking_raylets_group]

BOOKING = "bk-grow"
NODES = [f"{BOOKING}-n{i}" for i in range(3)]  # one raylet each, named so
ADDED_NODE = NODES[2]  # the booking's first two are bk-grow-n0 and -n1
# A hang guard for each wait on the run (start-up, a resize, the end).
WAIT_S = float(os.environ.get("ITO_TEST_WAIT_S", "240"))
# Operator knob: paced so the run outlasts a grow and a shrink. The grow is the long
# one: the new group's process starts and builds its model while the run trains on
# (about 33 s from the booking change on a loaded 2-core host, ~90 steps here).
PACE_STEP_S = 0.25
STEPS = 200
# A run that only shrinks (nothing to launch) is short: at load 19, with the booking
# changed by a CLI process, the shrink applied at step 20 (of 80), 2.06 s after the
# change; the change is now stored without a process, and the run has 30 steps more.
TAKEN_BACK_STEPS = 50
# 12 sequences of 32 tokens a step: 6 a group at 2 groups, 4 at 3.
SEQ_LEN = 32
GLOBAL_BATCH_TOKENS = 384
# The resized run's final loss against the unresized one's, relative. Both train the
# same sequences in the same order with the same LR schedule; only the gradient
# average's summation order differs while grown (3 partial sums instead of 2), an fp32
# rounding difference (4e-7 relative at the end, measured) that Adam carries but does
# not blow up in this many steps. The bound leaves 250x that; what was trained (each
# share once) is the ledger's to prove.
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("booking-resize")
    mark = {f"booking:{BOOKING}": 1.0}
    # The third node is up from the start, outside the booking until it is added:
    # each reservation takes the booking's nodes by their names.
    raylets = {node: {**mark, node_resource(node): 1.0} for node in NODES}
    with (
        booking_raylets(request, tmp_path_factory, raylets) as (cluster, _),
        server_on_cluster(
            tmp,
            cluster,
            [cpu_booking_doc(BOOKING, "acme", gpus=1, nodes=2)],
            {"ITO_TRAIN_OVERRIDES": json.dumps({"pace_step_s": PACE_STEP_S})},
        ) as (be, tenant, corpus),
    ):
        yield {"backend": be, "tenant": tenant, "tmp": tmp, "cluster": cluster, "corpus": corpus}


def _submit(env: dict[str, Any], name: str, steps: int = STEPS) -> str:
    be: Backend = env["backend"]
    t: Tenant = env["tenant"]
    m = cpu_testbed_manifest(
        [data_ref(env["corpus"], license="PSF")], env["tmp"] / f"ckpt-{name}", steps=steps
    )
    m["training"] |= {"seq_len": SEQ_LEN, "global_batch_tokens": GLOBAL_BATCH_TOKENS}
    with be.client() as c:
        return submit_run(c, t, BOOKING, m)


def _wait(env: dict[str, Any], run_id: str, pred: Any, what: str) -> dict[str, Any]:
    return wait_run(env["backend"], env["tenant"].submitter, run_id, pred, what, WAIT_S)


def _events(env: dict[str, Any], run_id: str, kind: str) -> list[dict[str, Any]]:
    store = Store(env["backend"].db)
    try:
        return [dict(e["payload"]) for e in store.list_events(run_id, kinds=[kind], limit=100_000)]
    finally:
        store.close()


def _change_nodes(env: dict[str, Any], action: str, *nodes: str) -> None:
    """A booking change as ``ito-backend bookings add-nodes``/``remove-nodes`` stores it,
    without the CLI process (the grow test runs the CLI)."""
    store = Store(env["backend"].db)
    try:
        store.change_booking_nodes(BOOKING, action, list(nodes))
    finally:
        store.close()


def _logs(env: dict[str, Any], run_id: str) -> list[str]:
    store = Store(env["backend"].db)
    try:
        return [e["message"] for e in store.list_logs(run_id, 0, 100_000)]
    finally:
        store.close()


def _applied(run: dict[str, Any], groups: int) -> dict[str, Any] | None:
    """The run's resize to ``groups`` groups once the trainer applied it."""
    return next(
        (r for r in run["resizes"] if r["status"] == "applied" and r["groups_after"] == groups),
        None,
    )


def _train_metrics(run: dict[str, Any]) -> dict[str, Any]:
    (gate,) = [g for g in run["stage_gates"] if g["stage"] == "train"]
    assert gate["status"] == "passed", gate
    metrics: dict[str, Any] = gate["metrics"]
    return metrics


def _ledger(env: dict[str, Any], run_id: str) -> dict[int, dict[int, tuple[int, int]]]:
    """step -> {group: (its place, members)} of every committed step, from the run's
    persisted step events (a merged event stands for its steps; a redone step's last
    report wins)."""
    ledger: dict[int, dict[int, tuple[int, int]]] = {}
    for raw in _events(env, run_id, "step"):
        for e in expand_steps(raw):
            if e["committed"] and e.get("batch_share") is not None:
                place, members = e["batch_share"]
                ledger.setdefault(int(e["step"]), {})[int(e["replica_group"])] = (place, members)
    return ledger


def _group_actors(env: dict[str, Any], run_id: str) -> dict[int, Any]:
    """The run's live rank actors by replica group (Ray's actor table)."""
    from ray.util.state import list_actors

    os.environ["RAY_AUTH_MODE"] = "token"
    actors = list_actors(
        address=env["cluster"].dashboard,
        filters=[("state", "=", "ALIVE")],
        limit=10_000,
        detail=True,
    )
    prefix = f"run-{run_id}-trainer-rg"
    return {
        int(a.name[len(prefix) :].split("-")[0]): a
        for a in actors
        if a.name and a.name.startswith(prefix)
    }


def _ray_nodes(env: dict[str, Any]) -> dict[str, str]:
    """Booking node name -> the Ray node started with it."""
    from ray.util.state import list_nodes

    os.environ["RAY_AUTH_MODE"] = "token"
    named = {}
    for n in list_nodes(address=env["cluster"].dashboard, detail=True, limit=10_000):
        for key in n.resources_total or {}:
            if key.startswith(node_resource("")):
                named[key.removeprefix(node_resource(""))] = n.node_id
    return named


def _reservations_left(env: dict[str, Any], *run_ids: str) -> dict[str, str]:
    from ray.util.state import list_placement_groups

    return {
        g.name: g.state
        for g in list_placement_groups(address=env["cluster"].dashboard, limit=10_000)
        if any(g.name.startswith(f"run-{r}") for r in run_ids)
    }


def test_a_node_taken_back_drains_the_groups_on_it_not_the_highest(
    env: dict[str, Any],
) -> None:
    steps = TAKEN_BACK_STEPS
    run_id = _submit(env, "taken-back", steps)
    _wait(
        env,
        run_id,
        lambda r: r["state"] == "running" and _ledger(env, run_id),
        "a committed step",
    )
    # Each group on the booking node of its bundle: group 0 on bk-grow-n0.
    nodes, groups = _ray_nodes(env), _group_actors(env, run_id)
    assert {g: a.node_id for g, a in groups.items()} == {0: nodes[NODES[0]], 1: nodes[NODES[1]]}
    _change_nodes(env, "remove", NODES[0])
    _wait(env, run_id, lambda r: _applied(r, 1) is not None, "the shrink applied")
    done = _wait(env, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    shrink = _applied(done, 1)
    assert shrink is not None and shrink["groups_before"] == 2, done["resizes"]

    # Group 0 (on the node taken back) was drained; group 1 trained on alone.
    fleet = _events(env, run_id, "fleet")
    drained = [e for e in fleet if e["action"] == "groups_drained"]
    assert [e["replica_group"] for e in drained] == [0], drained
    # The ledger: every step once, its batch in one share per member; group 1 alone
    # from the shrink on.
    ledger = _ledger(env, run_id)
    assert sorted(ledger) == list(range(1, steps + 1)), sorted(ledger)
    for step, shares in ledger.items():
        (count,) = {m for _, m in shares.values()}
        assert sorted(place for place, _ in shares.values()) == list(range(count)), (step, shares)
        assert set(shares) == ({0, 1} if count == 2 else {1}), (step, shares)
    alone = [s for s, shares in ledger.items() if set(shares) == {1}]
    assert alone == list(range(alone[0], steps + 1)) and alone[0] <= shrink["step"], (
        alone,
        done["resizes"],
    )
    assert _train_metrics(done)["tokens"] == steps * GLOBAL_BATCH_TOKENS

    # The booking as the next test needs it: bk-grow-n0 back, the run's nodes free.
    _change_nodes(env, "add", NODES[0])
    wait_until(
        lambda: set(_reservations_left(env, run_id).values()) <= {"REMOVED"},
        60.0,
        f"reservations removed: {_reservations_left(env, run_id)}",
    )


def test_a_node_swapped_at_the_same_count_moves_its_group_to_the_gained_node(
    env: dict[str, Any],
) -> None:
    """bk-grow-n0 taken back and bk-grow-n2 added in one supervisor pass: two groups
    still fit, so the request keeps the count; under that one request a new group starts
    on n2 and heals from a live peer (a grow to 3), then the group on n0 is drained."""
    run_id = _submit(env, "swapped")
    _wait(
        env,
        run_id,
        lambda r: r["state"] == "running" and _ledger(env, run_id),
        "a committed step",
    )
    # Which group is on n0 follows the booking's order of its nodes (the earlier test
    # took n0 back and added it again: it may be the booking's second node now).
    nodes, groups = _ray_nodes(env), _group_actors(env, run_id)
    on_n0 = {g for g, a in groups.items() if a.node_id == nodes[NODES[0]]}
    assert len(on_n0) == 1 and set(groups) == {0, 1}, (groups, nodes)
    (leaving,) = on_n0
    (staying,) = {0, 1} - on_n0
    # Both changes in one pass of the supervisor (each audited command takes a second).
    store = Store(env["backend"].db)
    try:
        store.change_booking_nodes(BOOKING, "remove", [NODES[0]])
        store.change_booking_nodes(BOOKING, "add", [NODES[2]])
    finally:
        store.close()
    _wait(env, run_id, lambda r: _applied(r, 2) is not None, "the swap applied")
    groups = _group_actors(env, run_id)
    assert {g: a.node_id for g, a in groups.items()} == {
        staying: nodes[NODES[1]],
        2: nodes[NODES[2]],
    }
    done = _wait(env, run_id, lambda r: r["state"] == "succeeded", "succeeded")
    # One request (the swap), or a shrink and a grow should the pass fall between.
    assert {r["status"] for r in done["resizes"]} == {"applied"}, done["resizes"]

    fleet = _events(env, run_id, "fleet")
    assert [e["replica_group"] for e in fleet if e["action"] == "groups_drained"] == [leaving]
    assert [e["replica_group"] for e in fleet if e["action"] == "groups_added"] == [2]
    assert not [e for e in fleet if e["action"] == "checkpoint_restored"], fleet
    # Every step once, its batch in one share per member: {0, 1}, then {0, 1, 2}, then
    # the staying group and 2, in that order.
    ledger = _ledger(env, run_id)
    assert sorted(ledger) == list(range(1, STEPS + 1)), sorted(ledger)
    members = []
    for step, shares in sorted(ledger.items()):
        (count,) = {m for _, m in shares.values()}
        assert sorted(place for place, _ in shares.values()) == list(range(count)), (step, shares)
        if not members or members[-1] != set(shares):
            members.append(set(shares))
    assert members == [{0, 1}, {0, 1, 2}, {staying, 2}], members
    assert _train_metrics(done)["tokens"] == STEPS * GLOBAL_BATCH_TOKENS

    # The booking as the next test needs it: bk-grow-n0 and -n1, the run's nodes free.
    _change_nodes(env, "remove", NODES[2])
    _change_nodes(env, "add", NODES[0])
    wait_until(
        lambda: set(_reservations_left(env, run_id).values()) <= {"REMOVED"},
        60.0,
        f"reservations removed: {_reservations_left(env, run_id)}",
    )


def test_a_run_grows_into_an_added_node_and_shrinks_back_with_every_token_counted_once(
    env: dict[str, Any],
) -> None:
    from ray.util.state import list_placement_groups

    db = env["backend"].db
    run_id = _submit(env, "resized")
    _wait(
        env,
        run_id,
        lambda r: r["state"] == "running" and _ledger(env, run_id),
        "a committed step",
    )
    admin(db, "bookings", "add-nodes", BOOKING, "--node", ADDED_NODE)
    grown = _wait(env, run_id, lambda r: _applied(r, 3) is not None, "the grow applied")

    # The added group runs on the added node, in the group reserved for it; the run's
    # two planned groups on the two nodes of the run's own reservation.
    groups = _group_actors(env, run_id)
    assert sorted(groups) == [0, 1, 2], sorted(groups)
    pgs = {
        g.placement_group_id: g.name
        for g in list_placement_groups(address=env["cluster"].dashboard, detail=True)
    }
    assert pgs[groups[2].placement_group_id].startswith(f"run-{run_id}-pg-c"), pgs
    assert pgs[groups[0].placement_group_id] == pgs[groups[1].placement_group_id]
    assert pgs[groups[0].placement_group_id] == f"run-{run_id}-pg"
    assert len({groups[g].node_id for g in (0, 1, 2)}) == 3, groups

    admin(db, "bookings", "remove-nodes", BOOKING, "--node", ADDED_NODE)
    _wait(env, run_id, lambda r: _applied(r, 2) is not None, "the shrink applied")
    done = _wait(env, run_id, lambda r: r["state"] in ("succeeded",), "succeeded")
    grow, shrink = _applied(done, 3), _applied(done, 2)
    assert grow is not None and shrink is not None, done["resizes"]
    assert (grow["groups_before"], shrink["groups_before"]) == (2, 3), done["resizes"]
    assert grow["step"] < shrink["step"] <= STEPS, done["resizes"]
    assert grown["state"] == "running"

    # The ledger: each committed step's global batch went out in exactly one share
    # per member group (places 0..n-1 once), 3 members between the two resizes.
    ledger = _ledger(env, run_id)
    assert sorted(ledger) == list(range(1, STEPS + 1)), sorted(ledger)
    for step, shares in ledger.items():
        members = {m for _, m in shares.values()}
        assert len(members) == 1, (step, shares)
        (count,) = members
        assert sorted(place for place, _ in shares.values()) == list(range(count)), (step, shares)
        assert set(shares) == ({0, 1, 2} if count == 3 else {0, 1}), (step, shares)
    grown_steps = [s for s, shares in ledger.items() if len(shares) == 3]
    assert grown_steps == list(range(grown_steps[0], grown_steps[-1] + 1)), grown_steps
    assert grown_steps[0] <= grow["step"] <= grown_steps[-1] < shrink["step"], (
        grown_steps,
        done["resizes"],
    )
    train = _train_metrics(done)
    assert train["tokens"] == STEPS * GLOBAL_BATCH_TOKENS, train

    # The joining group healed from a live peer: no checkpoint was read.
    fleet = _events(env, run_id, "fleet")
    assert not [e for e in fleet if e["action"] == "checkpoint_restored"], fleet
    added = [e for e in fleet if e["action"] == "groups_added"]
    assert [e["replica_group"] for e in added] == [2], added
    logs = _logs(env, run_id)
    assert any(m.startswith("rg2: healed from a live peer") for m in logs)
    # The added node's reservation was given back once its group drained, mid-run (the
    # run's end releases the others).
    assert any(f"released the reservation {pgs[groups[2].placement_group_id]}:" in m for m in logs)

    # The same final loss as the same manifest never resized, on the same backend. A
    # run that never resizes needs no pacing, and the pace only sleeps between steps
    # (the loss does not depend on it): the server restarts without the pace knob (its
    # store, cluster and launch key stay), or the reference would sleep STEPS x pace.
    be: Backend = env["backend"]
    be.env = {k: v for k, v in be.env.items() if k != "ITO_TRAIN_OVERRIDES"}
    be.restart()
    still_id = _submit(env, "still")
    still = _wait(env, still_id, lambda r: r["state"] == "succeeded", "succeeded")
    assert not still["resizes"]
    reference = _train_metrics(still)
    assert reference["tokens"] == train["tokens"]
    assert abs(train["final_loss"] - reference["final_loss"]) <= LOSS_RTOL * abs(
        reference["final_loss"]
    ), (train["final_loss"], reference["final_loss"])

    # Both runs' reservations went with them (released just after a run's end).
    wait_until(
        lambda: set(_reservations_left(env, run_id, still_id).values()) <= {"REMOVED"},
        60.0,
        f"reservations removed: {_reservations_left(env, run_id, still_id)}",
    )
