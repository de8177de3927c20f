"""The main job: the whole product end to end on one machine (SQLite + local Ray).

It does what an operator and a tenant would do, through the same commands:
creates an account, a submitter key and an approver key, registers a booking,
writes data and a manifest for the tiny model, starts ``ito-backend serve``
(which starts the embedded Ray head), confirms as the approver, runs the exact
``ito train ... --json`` command, follows the run, and prints status, stage gates,
checkpoints and goodput. Its last line is the run's final ``ito status --json``.

    python -m orchestrator.demo [--var-dir .demo] [--keep-running]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from orchestrator.runtime import ray_cluster

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SERVER_START_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _cli(args: list[str], env: dict[str, str], *, check: bool = True) -> dict[str, Any]:
    """Run one ito / ito-backend command with --json and return its envelope."""
    proc = subprocess.run(
        [str(BIN / args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        envelope: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(
            f"[demo] {args[0]} {args[1]} printed no envelope:\n{proc.stdout}\n{proc.stderr}"
        ) from None
    if check and not envelope.get("ok"):
        raise SystemExit(f"[demo] {' '.join(args[:2])} failed: {json.dumps(envelope)}")
    return envelope


def _write_data(data_dir: Path, rng: random.Random) -> tuple[Path, Path]:
    """Baseline: stdlib docstrings. Custom: GSM8K-train math text, with planted
    near-duplicates and GSM8K-test questions so dedup and decontamination show work."""
    data_dir.mkdir(parents=True, exist_ok=True)
    baseline = data_dir / "baseline.jsonl"
    shutil.copyfile(REPO / "data" / "python_docs" / "train.jsonl", baseline)
    train = [
        json.loads(line)
        for line in (REPO / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:3000]
    ]
    test = [
        json.loads(line)
        for line in (REPO / "configs" / "evals" / "gsm8k" / "test.jsonl").read_text().splitlines()
    ]
    docs = [f"{t['question']}\n{t['answer']}" for t in train]
    for doc in rng.sample(docs, 40):  # near-duplicates: one word changed
        words = doc.split()
        words[rng.randrange(len(words))] = "indeed"
        docs.append(" ".join(words))
    for item in rng.sample(test, 25):  # leaked eval questions
        docs.append(f"Practice problem. {item['question']} Show your work.")
    rng.shuffle(docs)
    custom = data_dir / "custom_math.jsonl"
    custom.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return baseline, custom


def _manifest(path: Path, baseline: Path, custom: Path, ckpt_dir: Path) -> None:
    from stages.data_prep import file_sha256

    def ref(p: Path, role: str, source: str, lic: str) -> dict[str, Any]:
        return {
            "uri": f"file://{p}",
            "sha256": file_sha256(p),
            "role": role,
            "format": "jsonl",
            "text_field": "text",
            "provenance": {"source": source, "license": lic, "decontaminated_against": []},
        }

    manifest = {
        "manifest_version": 1,
        "name": "demo-llama-tiny",
        "model": {
            "preset": "llama-tiny",
            "architecture": "llama",
            "size": "124K",
            "revision": "random-init",
        },
        "data": {
            "refs": [
                ref(baseline, "baseline", "CPython 3.11 stdlib docstrings", "PSF-2.0"),
                ref(custom, "custom", "GSM8K train (demo extract)", "MIT"),
            ],
            "eval_suites": ["gsm8k"],
            "ladder_probe": {"enabled": True, "seeds": 2, "token_budget": 60000},
        },
        "training": {
            "max_steps": 60,
            "seq_len": 64,
            "global_batch_tokens": 2048,
            "learning_rate": 0.003,
            "warmup_steps": 5,
            "seed": 0,
        },
        # Two phases, each closed by the smoke battery (held-out loss and bits per byte,
        # GSM8K-style exact match and multiple choice through lm-eval) and its gate.
        "curriculum": {
            "phases": [
                {
                    "name": "pretrain",
                    "kind": "pretrain",
                    "token_fraction": 0.5,
                    "seq_len": 64,
                    "eval_battery": "smoke",
                    "gates": [
                        {"metric": "heldout_loss", "max": 6.0},
                        {"metric": "heldout_bits_per_byte", "max": 9.0},
                        {"metric": "arith_mc_acc", "min": 0.0},
                    ],
                },
                {
                    "name": "long_context",
                    "kind": "long_context",
                    "token_fraction": 0.5,
                    "seq_len": 128,
                    "eval_battery": "smoke",
                    "gates": [
                        {"metric": "heldout_loss", "max": 6.0, "max_regression": 0.5},
                        {"metric": "heldout_bits_per_byte", "max": 9.0},
                        {"metric": "gsm8k_exact_match", "min": 0.0},
                    ],
                },
            ]
        },
        "budget": {"ceiling_usd": 5.0, "max_incremental_cost_usd": 5.0},
        "checkpoint": {"interval_steps": 20, "keep": 2, "storage_uri": f"file://{ckpt_dir}"},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=2)


def _start_server(
    env: dict[str, str], db: Path, var_dir: Path, port: int, ray_port: int, dashboard_port: int
) -> subprocess.Popen[bytes]:
    log = open(var_dir / "server.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [
            str(BIN / "ito-backend"),
            "serve",
            "--db",
            str(db),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--runtime",
            "ray",
            "--var-dir",
            str(var_dir / "server"),
            "--ray-head-port",
            str(ray_port),
            "--ray-dashboard-port",
            str(dashboard_port),
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
        ],  # any free port: one per host
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"[demo] server exited; see {var_dir / 'server.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("[demo] server did not become healthy in time")


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
    var_dir: Path, *, preset: str = "llama-tiny", say: Callable[[str], None] = lambda _: None
) -> DemoSetup:
    """The operator's steps (account, a submitter and an approver key, the booking,
    the account's roots) and the tenant's (data and a manifest for ``preset``), all
    through the real CLIs, in the empty folder ``var_dir``. The demo and
    benchmarks/pipeline.py both start here."""
    db = var_dir / "ito.db"
    port = _free_port()
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
    _cli(["ito-backend", "accounts", "create", "demo", "--json"], env)
    submitter = _cli(
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
    approver = _cli(
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
    _cli(["ito-backend", "bookings", "add", str(booking_file), "--json"], env)
    say(f"booking {booking_id}: 1 node x 2 cpu-testbed ranks, fabric loopback")

    baseline, custom = _write_data(var_dir / "data", random.Random(0))
    (var_dir / "checkpoints").mkdir()
    # The operator confines the account: its data and checkpoints only under these roots.
    _cli(
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
    manifest = var_dir / "manifest.json"
    _manifest(manifest, baseline, custom, var_dir / "checkpoints")
    if preset != "llama-tiny":
        doc = json.loads(manifest.read_text())
        doc["model"]["preset"] = preset
        manifest.write_text(json.dumps(doc, indent=2))
    return DemoSetup(db, port, env, submitter, approver, booking_id, manifest)


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
    booking_id, submitter, approver = setup.booking_id, setup.submitter, setup.approver
    _say(
        f"manifest {manifest} (llama-tiny, 60 steps, 2 replica groups, phases pretrain "
        "@64 then long_context @128 tokens)"
    )

    _say("starting ito-backend serve (SQLite + embedded Ray head)")
    server = _start_server(env, db, var_dir, port, _free_port(), _free_port())
    try:
        confirm = _cli(
            [
                "ito",
                "confirm",
                "--action",
                "train",
                "--booking",
                booking_id,
                "--manifest",
                str(manifest),
                "--json",
            ],
            {**env, "ITO_API_KEY": approver},
        )
        ref = confirm["data"]["confirmation_ref"]
        _say(f"approver confirmed: cost {confirm['data']['cost_usd']} USD, reference issued")
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
        key = f"demo-{uuid.uuid4().hex[:12]}"
        sub_env = {**env, "ITO_API_KEY": submitter}
        cmd = [
            "ito",
            "train",
            "--booking",
            booking_id,
            "--manifest",
            str(manifest),
            "--confirmation-ref",
            ref,
            "--idempotency-key",
            key,
            "--json",
        ]
        print("$ " + " ".join(cmd).replace(ref, "<confirmation-ref>"), flush=True)
        accepted = _cli(cmd, sub_env)
        print(json.dumps(accepted), flush=True)
        run_id = accepted["data"]["run_id"]
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
        for gate in data.get("eval_gates") or []:
            checks = ", ".join(
                f"{c['check']}={c['score']:.4g}"
                + "".join(
                    f" {k}={c[k]:g}"
                    for k in ("min", "max", "max_regression")
                    if c.get(k) is not None
                )
                for c in gate["checks"]
                if c["score"] is not None
            )
            _say(
                f"gate {gate['phase']} ({gate['battery']}, step {gate['step']}): "
                f"{'PASSED' if gate['passed'] else 'FAILED'}: {checks}"
            )
        metrics = subprocess.run(
            [str(BIN / "ito"), "metrics", "--run", run_id, "--json"],
            env=sub_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        m = json.loads(metrics.stdout)["data"]
        evaluation, elapsed = m["badput_s"]["evaluation"], m["elapsed_s"]
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
