"""Runs on a real Ray-backed server for the end-to-end modules: the paced server a
module (``paced_backend``) or several (``shared_paced_server``) share, submitting the
CPU-testbed manifest, reading the run back through the API, and the run's live Ray
actors. ``rt`` is the dict ``paced_backend`` yields."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

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
# And while a group is missing: a killed group's replacement (a standby warmed at idle
# priority, or a new process) is back before the run ends however loaded the host.
DEGRADED_PACE_STEP_S = 0.5


@contextmanager
def paced_backend(
    tmp: Path, booking_id: str, env: dict[str, str] | None = None, db: str | None = None
) -> Iterator[dict[str, Any]]:
    """A Ray-backed server whose runs are paced, with two corpora (``baseline``,
    ``custom``) beside it; ``env`` adds to the server's environment; ``db``: its store
    (a PostgreSQL URL; SQLite by default)."""
    baseline, custom = corpora(tmp / "data", 400, 300)
    env = {
        **(env or {}),
        "ITO_TRAIN_OVERRIDES": json.dumps(
            {"pace_step_s": PACE_STEP_S, "degraded_pace_step_s": DEGRADED_PACE_STEP_S}
        ),
    }
    with ray_backend(tmp, booking_id, env=env, db=db) as rt:
        yield {**rt, "baseline": baseline, "custom": custom}


def shared_paced_server(tmp: Path, canary: str) -> Iterator[dict[str, Any]]:
    """The session's one paced server for the modules that submit testbed runs
    (the ``paced_server`` fixture of tests/runtime/conftest.py): a server with its
    embedded Ray head takes ~20 s to start and ~4 s to stop on the 2-core testbed.
    ``canary`` is a secret in its environment from its start, for every run to leak
    (test_run_controls_on_ray.py's canary test looks for it). ``rt["close"]`` stops it
    early, once its last module is done (:func:`serve_module`)."""
    env = {"ITO_CANARY_TOKEN": canary, "OPENAI_API_KEY": canary}
    with ExitStack() as stack:
        rt = stack.enter_context(paced_backend(tmp, "bk-cpu", env))
        yield {**rt, "canary": canary, "close": stack.close}


def serve_module(rt: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A module fixture's body over the shared server: it is running for the module
    (a module before may have stopped it: test_runs_on_ray.py's last test ends with a
    SIGTERM), and the last module of the session that uses it stops it with it, so its
    Ray head does not idle through the rest of the suite. Under pytest-xdist a worker
    that does not run that last module stops it at its session's end."""
    be = rt["backend"]
    if be.proc is None or be.proc.poll() is not None:
        be.proc = None
        be.start()
    yield rt
    users = [i for i in request.session.items if "paced_server" in getattr(i, "fixturenames", ())]
    if users and getattr(users[-1], "module", None) is request.module:
        rt["close"]()


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
