"""Post-training through the canonical API on a real local Ray: ``ito confirm`` and
``ito train`` with a manifest whose recipe is sft -> dpo -> rlvr, after a short
pretraining; the tiny policy's mean reward on a synthetic verifiable task rises
within the step budget; each objective is saved in HF format; the rollout fleet's gauges
reach ``ito metrics`` and ``/metrics``. Only the GPUs are absent."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.backend import Backend
from helpers.flows import submit_run
from helpers.manifests import cpu_testbed_manifest, data_ref, write_manifest
from helpers.ray_backend import ray_backend
from helpers.tenants import Tenant
from helpers.testbed_runs import run_actors, wait_for_run
from helpers.waiting import wait_until
from helpers.xdist_groups import module_group

from orchestrator.client import human
from orchestrator.client.api import ItoClient
from orchestrator.client.cli import run_cli
from orchestrator.client.render import readable
from orchestrator.client.transport import ClientSettings
from orchestrator.db.store import Store
from tests.post_training.conftest import base_model

# Above pytest's 300 s default: a run may take RUN_TIMEOUT_S once the server is up.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), module_group(__name__)]
REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 420.0


def _client(url: str, key: Any, settings: ClientSettings | None = None) -> ItoClient:
    s = (settings or ClientSettings()).model_copy(
        update={"retry_backoff_s": 0.0, "total_timeout_s": 30.0}
    )
    return ItoClient(url, key, settings=s)


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with ray_backend(
        tmp_path_factory.mktemp("pt-runtime"), "bk-pt", gpus_per_node=1, planner_gate=False
    ) as rt:
        yield rt


def _ref(p: Path, role: str = "custom", text_field: str = "text") -> dict[str, Any]:
    return data_ref(p, role, text_field=text_field)


def _manifest(tmp: Path, policy: Path, task: dict[str, Path]) -> dict[str, Any]:
    docs = tmp / "docs.jsonl"
    lines = (REPO / "data" / "python_docs" / "train.jsonl").read_text().splitlines()[:200]
    docs.write_text("\n".join(lines) + "\n")
    return cpu_testbed_manifest(
        [_ref(docs, "baseline")],
        tmp / "ckpt",
        steps=4,
        name="post-training-e2e",
        interval_steps=2,
        keep=1,
        warmup_steps=1,
        post_training={
            **base_model(policy),
            "sft": {"data": _ref(task["sft"]), "steps": 20, "learning_rate": 5e-3},
            "dpo": {"data": _ref(task["dpo"]), "steps": 10, "learning_rate": 1e-3},
            # eta = 0 with fixed seeds: the same updates as the synchronous loop whatever
            # the timing (test_fleet.py), so the reward curve is reproducible; eta > 0 and
            # a worker kill are test_fleet_ray.py.
            "rlvr": {
                "data": _ref(task["rlvr"]),
                "steps": 14,
                "reward": "first_number_match",
                "group_size": 8,
                "groups_per_step": 4,
                "max_completion_tokens": 4,
                "overlong_buffer_tokens": 1,
                "overlong_penalty_factor": 0.0,
                "learning_rate": 5e-2,
                "max_staleness": 0,
                "rollout_workers": 2,
                "gate": {"metric": "reward_gain", "min": 0.2},
            },
        },
    )


def test_ito_train_runs_sft_dpo_rlvr_and_the_reward_rises(
    rt: dict[str, Any],
    tiny_policy: Path,
    task_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    be: Backend = rt["backend"]
    t: Tenant = rt["tenant"]
    manifest = write_manifest(tmp_path / "m.json", _manifest(rt["tmp"], tiny_policy, task_files))
    monkeypatch.setenv("ITO_API_URL", be.url)

    def cli(argv: list[str], key: str) -> dict[str, Any]:
        monkeypatch.setenv("ITO_API_KEY", key)
        status, env = run_cli(argv, client_factory=_client)
        assert status == 0, env
        return dict(env)

    ref = cli(
        [
            "confirm",
            "--action",
            "train",
            "--booking",
            t.booking_id,
            "--manifest",
            str(manifest),
            "--json",
        ],
        t.approver,
    )["data"]["confirmation_ref"]
    run_id = cli(
        [
            "train",
            "--booking",
            t.booking_id,
            "--manifest",
            str(manifest),
            "--confirmation-ref",
            ref,
            "--idempotency-key",
            "pt-e2e-0001",
            "--json",
        ],
        t.submitter,
    )["data"]["run_id"]

    def finished() -> dict[str, Any] | None:
        # Through the CLI, as the tenant polls (the run-state poller of the other
        # end-to-end tests, helpers.runs, reads the API directly).
        run: dict[str, Any] = cli(["status", "--run", run_id, "--json"], t.submitter)["data"]
        return run if run["state"] in ("succeeded", "failed", "cancelled") else None

    run = wait_until(finished, RUN_TIMEOUT_S, f"run {run_id} to finish", poll_s=1.0)
    gates = {g["stage"]: g for g in run.get("stage_gates", [])}
    if run.get("state") != "succeeded":
        logs = cli(["logs", "--run", run_id, "--json"], t.submitter)["data"]
        raise AssertionError(json.dumps(run)[-3000:] + json.dumps(logs)[-4000:])
    pt = gates["post_training"]
    assert pt["status"] == "passed"
    m = pt["metrics"]
    assert m["sft_nll_gain"] > 0 and m["dpo_margin_gain"] > 0
    assert m["rlvr_reward_last"] > m["rlvr_reward_first"] + 0.2, m
    assert m["rlvr_staleness_max"] == 0
    # Each objective's gate in the run view, as the stage decided it, and in ito status.
    assert [(g["objective"], g["status"]) for g in run["post_training_gates"]] == [
        ("sft", "passed"),
        ("dpo", "passed"),
        ("rlvr", "passed"),
    ]
    rlvr_gate = run["post_training_gates"][2]
    assert (rlvr_gate["metric"], rlvr_gate["min"]) == ("reward_gain", 0.2)
    assert rlvr_gate["value"] == m["rlvr_reward_gain"]
    assert (
        f"objective gate rlvr (gate reward_gain {human.score(m['rlvr_reward_gain'])}, min 0.2, "
        "step 14): passed" in readable("status", run)
    )
    # One trainer fleet for the run: every objective trained on pretraining's actors,
    # under pretraining's lighthouse.
    started = [
        e["payload"]
        for e in Store(be.db).list_events(run_id, kinds=["fleet"])
        if e["payload"]["action"] == "lighthouse_started"
    ]
    assert [e["stage"] for e in started] == ["train"] + ["post_training"] * 3
    assert all(e["actors"] == started[0]["actors"] for e in started), started
    assert all(e["address"] == started[0]["address"] for e in started), started
    out = rt["tmp"] / "ckpt" / run_id / "post_training"
    for objective in ("sft", "dpo", "rlvr"):
        assert (out / objective / "config.json").is_file()
        assert (out / objective / "tokenizer_config.json").is_file()
    metrics = cli(["metrics", "--run", run_id, "--json"], t.submitter)["data"]
    rl = metrics["post_training"]
    for key in (
        "rollout_samples_per_s",
        "trainer_idle_frac",
        "rollout_idle_frac",
        "weight_sync_s",
        "staleness_min",
        "staleness_mean",
        "staleness_max",
        "drop_rate",
        "mean_reward",
    ):
        assert key in rl, key
    assert rl["rollout_samples_per_s"] > 0
    import httpx

    text = httpx.get(be.metrics_url, timeout=30).text
    line = f'ito_run_rollout_samples_per_second{{booking_id="{t.booking_id}",run_id="{run_id}"}}'
    assert line in text


def test_a_driver_sigkilled_during_dpo_is_relaunched_skips_sft_and_resumes_dpo(
    rt: dict[str, Any], tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    """The run's RunDriver process is SIGKILLed once DPO has saved a checkpoint; the
    supervisor relaunches it, the new driver takes SFT's passed result as it is (no SFT
    step after the kill) and DPO's engine resumes from its newest checkpoint, not from
    step 1, and the run succeeds with every DPO step trained."""
    dpo_steps, every = 60, 4
    m = _manifest(rt["tmp"], tiny_policy, task_files)
    m["name"] = "post-training-driver-kill"
    pt = m["post_training"]
    del pt["rlvr"]
    pt["sft"]["steps"] = 2
    pt["dpo"].update(steps=dpo_steps, checkpoint_every_steps=every, gate=None)
    with rt["backend"].client() as c:
        run_id = submit_run(c, rt["tenant"], rt["tenant"].booking_id, m)
    store = Store(rt["backend"].db)

    def dpo_checkpoints() -> list[int]:
        return [
            e["payload"]["step"]
            for e in store.list_events(run_id, kinds=["checkpoint"])
            if e["payload"].get("stage") == "post_training" and e["payload"]["phase"] == "dpo"
        ]

    wait_until(lambda: any(s >= 2 * every for s in dpo_checkpoints()), RUN_TIMEOUT_S, "DPO saved")
    (driver,) = [a for a in run_actors(rt, run_id) if a.name == f"run-{run_id}"]
    os.kill(int(driver.pid), signal.SIGKILL)  # the driver dies, its engine's ranks with it

    run = wait_for_run(
        rt, run_id, lambda r: r["state"] in ("succeeded", "failed"), "its end", RUN_TIMEOUT_S
    )
    assert run["state"] == "succeeded", run["state_reason"]
    (lost,) = [
        e["payload"]
        for e in store.list_events(run_id, kinds=["interruption"])
        if e["payload"]["interruption_kind"] == "driver_lost"
    ]
    assert lost["recovered_at"] is not None  # relaunched, not failed
    steps = [e["payload"] for e in store.list_events(run_id, kinds=["step"])]

    def after_loss(phase: str) -> list[int]:
        return sorted(
            s["step"]
            for s in steps
            if s.get("stage") == "post_training"
            and s["phase"] == phase
            and s["ts"] > lost["detected_at"]
        )

    assert not after_loss("sft"), after_loss("sft")  # SFT's gate had passed: not re-run
    dpo = after_loss("dpo")
    assert dpo, "no DPO step after the driver was lost"
    # The relaunch trained on from a checkpoint (the lost driver may not have forwarded
    # its newest one's event), and to the end.
    assert dpo[0] > 1 and (dpo[0] - 1) % every == 0, dpo[:5]
    assert dpo[-1] == dpo_steps
    gates = {g["stage"]: g["status"] for g in run["stage_gates"]}
    assert gates["post_training"] == "passed", gates
