"""A run's driver as the supervisor sees it on Ray: the launch spec built from the
store's record of the run, starting the detached driver actor, finding it by name,
killing every actor of the run, and telling a lost node from a lost driver.

The supervisor (``orchestrator/runtime/supervisor.py``) decides when each happens;
these functions hold no state of their own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.db.store import Row, Store
from orchestrator.runtime import launch, placement
from orchestrator.runtime.interface import run_dir
from orchestrator.runtime.launch import LaunchSpec
from orchestrator.runtime.ray_cluster import RAY_NAMESPACE
from orchestrator.runtime.supervisor_settings import SupervisorSettings
from stages.placement import actor_options
from stages.run_facts import BookingTopology, PlacementFact, RunFacts


def driver_name(run_id: str) -> str:
    return f"run-{run_id}"


def checkpoint_dir(run: Row) -> Path:
    """The run's checkpoint folder: its manifest's storage root, then the run id."""
    manifest = json.loads(run["manifest_json"])
    root: str = manifest["checkpoint"]["storage_uri"].removeprefix("file://")
    run_id: str = run["run_id"]
    return Path(root) / run_id


def driver_attempts(store: Store, run_id: str) -> int:
    """The launch the run's next driver is: one more than the drivers it lost."""
    lost = store.list_events(run_id, kinds=["interruption"])
    return 1 + sum(
        1 for e in lost if e["payload"].get("interruption_kind") in ("driver_lost", "node_lost")
    )


def input_roots(
    store: Store, account_id: str, settings: SupervisorSettings
) -> dict[str, tuple[str, ...]]:
    """The account's roots as the stages check them again at run time: data refs
    in the data roots, model folders in the data or checkpoint roots."""
    data = store.roots(account_id, "data")
    ckpt = (*store.roots(account_id, "checkpoint"), *settings.checkpoint_roots)
    return {"data_roots": tuple(data), "model_roots": tuple(dict.fromkeys((*data, *ckpt)))}


def launch_spec(
    store: Store,
    run: Row,
    *,
    var_dir: Path,
    settings: SupervisorSettings,
    attempt: int,
    placed: PlacementFact | None,
) -> LaunchSpec:
    """The signed spec of the run's ``attempt``-th driver: the run as the store holds
    it, the stages that already passed (a relaunch skips them), and the run's facts."""
    run_id = run["run_id"]
    booking = store.booking(run["booking_id"]) or {}
    completed = {
        g["stage"]: {
            "stage": g["stage"],
            "status": g["status"],
            "reason": g["reason"],
            "metrics": json.loads(g["metrics"]),
            "artifacts": json.loads(g["artifacts"]),
            "error_code": g["error_code"],
        }
        for g in store.list_stage_gates(run_id)
        if g["status"] == "passed"
    }
    return launch.sign(
        LaunchSpec(
            run_id=run_id,
            booking_id=run["booking_id"],
            account=run["account_id"],
            manifest_digest=run["manifest_digest"],
            manifest_json=run["manifest_json"],
            accepted_at=run["created_at"],
            workdir=str(run_dir(var_dir, run_id)),
            checkpoint_dir=str(checkpoint_dir(run)),
            facts=RunFacts(
                booking=BookingTopology.model_validate(
                    {k: booking.get(k) for k in BookingTopology.model_fields}
                ),
                placement=placed,
                device="cpu" if placed is None else placed.device,
                account=run["account_id"],
                train_overrides=settings.train_overrides,
                **input_roots(store, run["account_id"], settings),
            ),
            completed_stages=completed,
            seq_start=store.max_seq(run_id) + 1,
            attempt=attempt,
        )
    )


def start_driver(spec: LaunchSpec) -> Any:
    """Create the run's detached driver in bundle 0 of its reservation and start it;
    a driver of that name already there is reattached to instead. Its handle."""
    from orchestrator.runtime.driver import driver_actor_class

    actor = driver_actor_class().options(
        name=driver_name(spec.run_id),
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=16,
        max_restarts=0,
        **actor_options(spec.facts, bundle_index=0),
    )
    try:
        handle = actor.remote(spec.model_dump())
    except ValueError:  # a driver of this name exists already: reattach to it
        handle = find_driver(spec.run_id)
    handle.start.remote()
    return handle


def find_driver(run_id: str) -> Any | None:
    """The run's live driver by its name, or None."""
    import ray

    try:
        return ray.get_actor(driver_name(run_id), namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def node_lost(run_id: str) -> str:
    """Why the driver went, when it was a node of the booking leaving ("" if not)."""
    import ray

    try:
        pg = placement.lookup(run_id)
        if pg is None:
            return ""
        from ray.util import placement_group_table

        table = placement_group_table(pg)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # type: ignore[no-untyped-call]
    except Exception:
        return ""
    gone = [n for n in (table.get("bundles_to_node_id") or {}).values() if n not in alive]
    if table.get("state") in ("RESCHEDULING", "PENDING") or gone:
        return "a node of the booking left the cluster" + (
            f" ({', '.join(n[:12] for n in gone)})" if gone else ""
        )
    return ""


def kill_run_actors(run_id: str, rpc_timeout_s: float) -> list[str]:
    """Kill the run's driver and every actor named after the run; the names killed."""
    import ray
    from ray.util.state import list_actors

    killed: list[str] = []
    prefix = driver_name(run_id)
    try:
        # This cluster's address, explicitly: without it the state API looks for
        # "a" Ray on the machine (/tmp/ray/ray_current_cluster), maybe another one.
        actors = list_actors(
            address=ray.get_runtime_context().gcs_address,
            filters=[("state", "!=", "DEAD")],
            limit=10_000,
            timeout=int(rpc_timeout_s),
            raise_on_missing_output=False,
        )
    except Exception:
        actors = []
    names = {
        a.name for a in actors if a.name and (a.name == prefix or a.name.startswith(prefix + "-"))
    }
    names.add(prefix)
    for name in sorted(names):
        try:
            ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
            killed.append(name)
        except ValueError:
            continue
    return killed
