"""Runs on a real Ray-backed server for the end-to-end modules: the paced server a
module shares (``paced_backend``), submitting the CPU-testbed manifest, reading the run
back through the API, and the run's live Ray actors. ``rt`` is the dict
``paced_backend`` yields."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers.flows import submit_run
from helpers.manifests import cpu_testbed_manifest, data_ref
from helpers.ray_backend import corpora, ray_backend
from helpers.runs import api_data, wait_run
from helpers.tenants import Tenant

# Imported for its side effect: Ray's token auth is configured before ray is imported.
from orchestrator.runtime import ray_cluster  # noqa: F401

RUN_TIMEOUT_S = 300.0
# A run's actors are reaped by Ray after its state is final: a hang guard, not a bound.
ACTORS_GONE_TIMEOUT_S = 120.0
# Operator knob: pace steps so a tiny model's run lasts long enough to cancel it, kill
# a group in it, or kill the API server under it.
PACE_STEP_S = 0.15


@contextmanager
def paced_backend(
    tmp: Path, booking_id: str, env: dict[str, str] | None = None, db: str | None = None
) -> Iterator[dict[str, Any]]:
    """A Ray-backed server whose runs are paced, with two corpora (``baseline``,
    ``custom``) beside it; ``env`` adds to the server's environment; ``db``: its store
    (a PostgreSQL URL; SQLite by default)."""
    baseline, custom = corpora(tmp / "data", 400, 300)
    env = {**(env or {}), "ITO_TRAIN_OVERRIDES": json.dumps({"pace_step_s": PACE_STEP_S})}
    with ray_backend(tmp, booking_id, env=env, db=db) as rt:
        yield {**rt, "baseline": baseline, "custom": custom}


def run_manifest(
    rt: dict[str, Any], *, steps: int, name: str | None = None, **sections: Any
) -> dict[str, Any]:
    """The CPU-testbed manifest on ``rt``'s two corpora."""
    refs = [data_ref(rt["baseline"], "baseline"), data_ref(rt["custom"], "custom")]
    return cpu_testbed_manifest(refs, rt["tmp"] / "ckpt", steps=steps, name=name, **sections)


def submit_testbed(
    rt: dict[str, Any],
    *,
    steps: int,
    tenant: Tenant | None = None,
    booking_id: str | None = None,
    **sections: Any,
) -> str:
    """Confirm and submit a ``steps``-step testbed run; its run id."""
    t: Tenant = tenant or rt["tenant"]
    m = run_manifest(rt, steps=steps, **sections)
    with rt["backend"].client() as c:
        return submit_run(c, t, booking_id or t.booking_id, m)


def api_get(rt: dict[str, Any], path: str, tenant: Tenant | None = None) -> dict[str, Any]:
    return api_data(rt["backend"], (tenant or rt["tenant"]).submitter, path)


def wait_for_run(
    rt: dict[str, Any],
    run_id: str,
    pred: Any,
    what: str,
    timeout_s: float = RUN_TIMEOUT_S,
    tenant: Tenant | None = None,
) -> dict[str, Any]:
    key = (tenant or rt["tenant"]).submitter
    return wait_run(rt["backend"], key, run_id, pred, what, timeout_s)


def last_step(rt: dict[str, Any], run_id: str, tenant: Tenant | None = None) -> int:
    metrics = api_get(rt, f"/v1/runs/{run_id}/metrics", tenant)
    return int(metrics.get("last_step") or 0)


def run_actors(rt: dict[str, Any], run_id: str) -> list[Any]:
    """The run's live actors (its driver and fleet), from the head's state API."""
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray.util.state import list_actors

    actors = list_actors(
        address=f"http://127.0.0.1:{rt['dashboard']}",
        filters=[("state", "=", "ALIVE")],
        limit=10_000,
        detail=True,
    )
    prefix = f"run-{run_id}"
    return [a for a in actors if a.name and (a.name == prefix or a.name.startswith(prefix + "-"))]
