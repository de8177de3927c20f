"""The main job: the whole product end to end on one machine (SQLite + local Ray).

It does what an operator and a tenant would do, through the same commands:
creates an account, a submitter key and an approver key, registers a booking,
writes data and a manifest for the tiny model, starts ``ito-backend serve``
(which starts the embedded Ray head), confirms as the approver, runs the exact
``ito train ... --json`` command, follows the run (data prep, the plan, two curriculum
phases, then post-training SFT -> DPO -> RLVR on the rollout fleet from pretraining's
HF export), and prints status, every gate (each phase's and each post-training objective's),
checkpoints and goodput. Its last line is the run's final ``ito status --json``.

    python -m orchestrator.demo [--var-dir .demo] [--keep-running]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from orchestrator.demo_manifest import (
    post_training_recipe,
    write_data,
    write_manifest,
    write_post_training_data,
)
from orchestrator.demo_server import BIN, run_cli, start_server
from orchestrator.gates.manifest import Manifest
from orchestrator.runtime import ray_cluster
from orchestrator.runtime.ports import free_port
from stages.post_training.config import PostTrainingConfig
from stages.post_training.gate_events import GATE_CONTEXT, gate_phase

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900.0


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


@dataclass(frozen=True)
class DemoSetup:
    """What the operator's and the tenant's first steps made: the store, the server's
    port and environment, the two keys, the booking and the manifest."""

    db: Path
    port: int
    env: dict[str, str]
    submitter: str
    approver: str
    booking_id: str
    manifest: Path


def prepare(
    var_dir: Path,
    *,
    preset: str = "llama-tiny",
    post_training: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> DemoSetup:
    """The operator's steps (account, a submitter and an approver key, the booking,
    the account's roots) and the tenant's (data and a manifest for ``preset``, with
    the post-training recipe unless ``post_training`` is False), all through the real
    CLIs, in the empty folder ``var_dir``. The demo and benchmarks/pipeline.py both
    start here."""
    db = var_dir / "ito.db"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ITO_API_KEY"}
    env.update(
        {
            "ITO_DB": str(db),
            "ITO_API_URL": f"http://127.0.0.1:{port}",
            "OMP_NUM_THREADS": "1",
            "ITO_LAUNCH_KEY_FILE": str(var_dir / "launch.key"),
        }
    )

    say("creating the demo account, a submitter key and an approver key")
    run_cli(["ito-backend", "accounts", "create", "demo", "--json"], env)
    submitter = run_cli(
        [
            "ito-backend",
            "keys",
            "issue",
            "--account",
            "demo",
            "--scope",
            "runs:read,runs:write",
            "--json",
        ],
        env,
    )["data"]["api_key"]
    approver = run_cli(
        [
            "ito-backend",
            "keys",
            "issue",
            "--account",
            "demo",
            "--scope",
            "confirm:train,confirm:cancel,confirm:cleanup,confirm:restart",
            "--json",
        ],
        env,
    )["data"]["api_key"]
    now = datetime.now(UTC)
    booking_id = f"bk_demo_{uuid.uuid4().hex[:8]}"
    booking_file = var_dir / "booking.json"
    booking_file.write_text(
        json.dumps(
            {
                "booking_id": booking_id,
                "account": "demo",
                "gpu_sku": "cpu-testbed",
                "gpus_per_node": 2,
                "node_count": 1,
                "region": "local",
                "fabric": "loopback",
                "term_start": (now - timedelta(minutes=5)).isoformat(),
                "term_end": (now + timedelta(hours=24)).isoformat(),
            }
        )
    )
    run_cli(["ito-backend", "bookings", "add", str(booking_file), "--json"], env)
    say(f"booking {booking_id}: 1 node x 2 cpu-testbed ranks, fabric loopback")

    baseline, custom = write_data(var_dir / "data", random.Random(0))
    (var_dir / "checkpoints").mkdir()
    # The operator confines the account: its data and checkpoints only under these roots.
    run_cli(
        [
            "ito-backend",
            "accounts",
            "roots",
            "demo",
            "--data",
            str(var_dir / "data"),
            "--checkpoint",
            str(var_dir / "checkpoints"),
            "--json",
        ],
        env,
    )
    recipe = None
    if post_training:
        recipe = post_training_recipe(
            write_post_training_data(var_dir / "data" / "post_training", random.Random(0))
        )
    manifest = var_dir / "manifest.json"
    write_manifest(manifest, baseline, custom, var_dir / "checkpoints", recipe)
    if preset != "llama-tiny":
        doc = json.loads(manifest.read_text())
        doc["model"]["preset"] = preset
        manifest.write_text(json.dumps(doc, indent=2))
    return DemoSetup(db, port, env, submitter, approver, booking_id, manifest)


def confirm_and_train(
    setup: DemoSetup,
    idempotency_key: str,
    *,
    say: Callable[[str], None] = lambda _: None,
    echo: Callable[[str], None] = lambda _: None,
) -> str:
    """The approver's ``ito confirm`` and the submitter's canonical ``ito train`` for
    the prepared manifest; returns the accepted run's id. The demo and
    benchmarks/pipeline.py both submit this way."""
    confirm = run_cli(
        [
            "ito",
            "confirm",
            "--action",
            "train",
            "--booking",
            setup.booking_id,
            "--manifest",
            str(setup.manifest),
            "--json",
        ],
        {**setup.env, "ITO_API_KEY": setup.approver},
    )
    ref = confirm["data"]["confirmation_ref"]
    say(f"approver confirmed: cost {confirm['data']['cost_usd']} USD, reference issued")
    cmd = [
        "ito",
        "train",
        "--booking",
        setup.booking_id,
        "--manifest",
        str(setup.manifest),
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        idempotency_key,
        "--json",
    ]
    echo("$ " + " ".join(cmd).replace(ref, "<confirmation-ref>"))
    accepted = run_cli(cmd, {**setup.env, "ITO_API_KEY": setup.submitter})
    echo(json.dumps(accepted))
    return str(accepted["data"]["run_id"])


def phase_gate_lines(run: dict[str, Any]) -> list[str]:
    """Each curriculum phase's gate from a run's ``ito status --json`` data (the
    post-training objectives' are there too: ``post_training_gate_lines`` shows them)."""
    lines = []
    objectives = {gate_phase(o) for o in ("sft", "dpo", "rlvr")}
    for gate in run.get("eval_gates") or []:
        if gate["phase"] in objectives:
            continue
        checks = ", ".join(
            f"{c['check']}={c['score']:.4g}"
            + "".join(
                f" {k}={c[k]:g}" for k in ("min", "max", "max_regression") if c.get(k) is not None
            )
            for c in gate["checks"]
            if c["score"] is not None
        )
        lines.append(
            f"gate {gate['phase']} ({gate['battery']}, step {gate['step']}): "
            f"{'PASSED' if gate['passed'] else 'FAILED'}: {checks}"
        )
    return lines


# The rollout fleet's figures (``ito metrics``) the demo's summary line shows.
_FLEET_FIGURES = (
    "rollout_samples_per_s",
    "trainer_idle_frac",
    "weight_sync_s",
    "staleness_max",
    "drop_rate",
)


def post_training_gate_lines(run: dict[str, Any], recipe: PostTrainingConfig) -> list[str]:
    """Each post-training objective's gate as the run decided it, from its ``ito status
    --json`` data: the stage's metrics hold ``<objective>_<metric>`` for every objective
    that ran, and the chain stops at the first failed gate, so in a failed stage the
    last objective that ran is the one that failed."""
    gate = next((g for g in run.get("stage_gates") or [] if g["stage"] == "post_training"), None)
    if gate is None:
        return []
    metrics: dict[str, float] = gate.get("metrics") or {}
    objectives = recipe.objectives()
    ran = [s for s in objectives if any(k.startswith(f"{s}_") for k in metrics)]
    lines = []
    for n, objective in enumerate(objectives, 1):
        head = f"gate post_training.{objective} (objective {n} of {len(objectives)})"
        if objective not in ran:
            lines.append(f"{head}: NOT RUN")
            continue
        failed = gate["status"] != "passed" and objective == ran[-1]
        verdict = "FAILED" if failed else "PASSED"
        objective_gate = getattr(recipe, objective).gate
        shown = (
            f"{objective_gate.metric}={metrics[f'{objective}_{objective_gate.metric}']:.4g} "
            f"min={objective_gate.min:g}"
            if objective_gate is not None and f"{objective}_{objective_gate.metric}" in metrics
            else "no gate metric"
        )
        context = ", ".join(
            f"{k}={metrics[f'{objective}_{k}']:.4g}"
            for k in GATE_CONTEXT[objective]
            if f"{objective}_{k}" in metrics
        )
        lines.append(f"{head}: {verdict}: {shown}" + (f" ({context})" if context else ""))
    if gate["status"] != "passed":
        lines.append(f"post_training failed: {gate.get('reason')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--var-dir", type=Path, default=REPO / ".demo")
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the API server and Ray head running at the end",
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    var_dir: Path = args.var_dir.resolve()
    ray_cluster.stop_local_head(var_dir / "server")  # a head left by an earlier demo
    if var_dir.exists():
        shutil.rmtree(var_dir)
    var_dir.mkdir(parents=True)
    setup = prepare(var_dir, say=_say)
    db, port, env, manifest = setup.db, setup.port, setup.env, setup.manifest
    booking_id, submitter = setup.booking_id, setup.submitter
    _say(
        f"manifest {manifest} (llama-tiny, 200 steps of 8192 tokens, 2 replica groups, "
        "phases pretrain @64 then long_context @128 tokens; post-training sft -> dpo -> rlvr "
        "on one-digit sums)"
    )

    _say("starting ito-backend serve (SQLite + embedded Ray head)")
    server = start_server(env, db, var_dir, port)
    try:
        plan = subprocess.run(
            [str(BIN / "ito"), "plan", "--booking", booking_id, "--manifest", str(manifest)],
            env={**env, "ITO_API_KEY": submitter},
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(
            f"$ ito plan --booking {booking_id} --manifest {manifest}\n" + plan.stdout.strip(),
            flush=True,
        )
        recipe = Manifest.model_validate_json(manifest.read_bytes()).post_training
        _say(
            "post-training from the last phase's HF export, each objective gated: "
            + " -> ".join(
                f"{s} ({getattr(recipe, s).steps} steps"
                + (f", gate {g.metric} >= {g.min:g})" if (g := getattr(recipe, s).gate) else ")")
                for s in recipe.objectives()
            )
        )
        sub_env = {**env, "ITO_API_KEY": submitter}
        run_id = confirm_and_train(
            setup,
            f"demo-{uuid.uuid4().hex[:12]}",
            say=_say,
            echo=lambda line: print(line, flush=True),
        )
        subprocess.run(
            [str(BIN / "ito"), "status", "--run", run_id, "--follow"],
            env=sub_env,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        for what in ("status", "checkpoints", "metrics"):
            print(f"\n$ ito {what} --run {run_id}", flush=True)
            subprocess.run(
                [str(BIN / "ito"), what, "--run", run_id], env=sub_env, check=False, timeout=60
            )
        final = subprocess.run(
            [str(BIN / "ito"), "status", "--run", run_id, "--json"],
            env=sub_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        data = json.loads(final.stdout)["data"]
        state = data["state"]
        for line in phase_gate_lines(data):
            _say(line)
        for line in post_training_gate_lines(data, recipe):
            _say(line)
        metrics = subprocess.run(
            [str(BIN / "ito"), "metrics", "--run", run_id, "--json"],
            env=sub_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        m = json.loads(metrics.stdout)["data"]
        evaluation, elapsed = m["badput_s"]["evaluation"], m["elapsed_s"]
        fleet = m.get("post_training") or {}
        if fleet:
            _say(
                "rlvr rollout fleet: "
                + ", ".join(
                    f"{k}={fleet[k]:.4g}"
                    for k in _FLEET_FIGURES
                    if isinstance(fleet.get(k), int | float)
                )
            )
        _say(
            json.dumps(
                {
                    "demo_eval_seconds": round(evaluation, 2),
                    "run_elapsed_seconds": round(elapsed, 2),
                    "eval_share_of_run": round(evaluation / elapsed, 4) if elapsed else None,
                }
            )
        )
        _say(f"finished in {time.monotonic() - t0:.0f}s, run {state}")
        print(final.stdout.strip(), flush=True)
        return 0 if state == "succeeded" else 1
    finally:
        if not args.keep_running:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            ray_cluster.stop_local_head(var_dir / "server")


if __name__ == "__main__":
    sys.exit(main())
