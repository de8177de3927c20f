"""Pipeline benchmark (CI: one short llama-tiny run only): the embedded pipeline end
to end, as the demo runs it (``orchestrator.demo``'s data, manifest, server, and its
``confirm_and_train``; the demo's post-training recipe left out unless
``--post-training``, which measures the demo's whole run), for two model presets
whose parameter counts differ ~25x (llama-tiny, llama-small).

For each preset it submits the demo's two-phase run through ``ito train`` and, from
the run's stored events and ``ito metrics``, reports:

- ``goodput``: productive step time / elapsed time (the API's goodput);
- ``accept_to_first_step_s``: run accepted -> its first committed step;
- ``phase_switch_s_max``: last committed step of a phase -> first committed step of
  the next (the gate included), the largest over the boundaries (with
  ``--post-training`` each objective is a phase too: the hand-over to it counts);
  ``phase_switch_s`` each of them, in order;
- ``startup_spans``: where accept -> first step went (``_spans``);
- ``eval_share``: evaluation badput / elapsed;
- ``badput_share``: each cause's badput / elapsed (each second counted once, so these
  and ``goodput`` add up to 1);
- ``driver_peak_rss_mb``: peak resident memory (VmHWM) of the RunDriver actor process;
- ``ladder``: the ladder probe's decision and where its proxies trained (the run's
  trainer ranks).

``driver_rss_growth`` is the larger preset's driver peak over the smaller's: a driver
that materialises the model grows with it. One JSON line on stdout.

    python -m benchmarks.pipeline [--presets llama-tiny llama-small] [--max-steps N]
        [--ladder-tokens N] [--post-training] [--var-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from orchestrator import demo
from orchestrator.demo_server import run_cli, start_server
from orchestrator.runtime import ray_cluster

RUN_TIMEOUT_S = 1800.0
RSS_SAMPLE_S = 0.5
# The run's state from the store (one SQLite read): a short poll ends the benchmark
# soon after the run does.
POLL_S = 0.5


def _driver_rss_kb(ray_temp: str) -> int:
    """Largest VmHWM among live RunDriver actor processes (Ray titles them
    ray::RunDriver) of this benchmark's own Ray head: a worker's parent is its raylet,
    whose command line names the head's temp dir (other clusters on the host are not
    counted)."""
    peak = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if not cmd.startswith(b"ray::RunDriver"):
                continue
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            if ray_temp.encode() not in Path(f"/proc/{parent}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except OSError:
            continue
    return peak


class _RssSampler(threading.Thread):
    def __init__(self, ray_temp: Path) -> None:
        super().__init__(daemon=True)
        self.ray_temp = str(ray_temp)
        self.peak_kb = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_kb = max(self.peak_kb, _driver_rss_kb(self.ray_temp))
            self.stop.wait(RSS_SAMPLE_S)


def _events(db: Path, run_id: str) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT payload FROM run_events WHERE run_id = ? ORDER BY seq", (run_id,)
        ).fetchall()
    return [json.loads(r[0]) for r in rows]


def _ladder(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The ladder probe's decision and where its proxies trained (data prep's outcome)."""
    for e in events:
        if e.get("kind") == "stage_result" and e["outcome"].get("stage") == "data_prep":
            probe = e["outcome"].get("artifacts", {}).get("ladder", {})
            return {"decision": probe.get("decision"), "trained_on": probe.get("trained_on", [])}
    return {}


def _state(db: Path, run_id: str) -> str:
    # From the store, not `ito status`: a CLI process per poll (a second of imports)
    # would take CPU from the run it measures.
    with sqlite3.connect(db) as con:
        return str(con.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0])


def _accepted_at(db: Path, run_id: str) -> float:
    with sqlite3.connect(db) as con:
        return float(
            con.execute("SELECT created_at FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
        )


def _spans(events: list[dict[str, Any]], accepted_at: float, first: float | None) -> dict[str, Any]:
    """Where accept -> first step went, each a time since acceptance (s): the driver
    running, the plan passed, the run's lighthouse up (its trainer ranks made),
    data prep's dedup and decontamination done, data prep passed (the ladder probe's
    proxies in between: ``ladder_probe_s``), the first step."""
    at: dict[str, Any] = {}

    def mark(name: str, ts: float | None) -> None:
        if ts is not None and name not in at:
            at[name] = round(ts - accepted_at, 2)

    for e in events:
        kind, stage = e.get("kind"), e.get("stage")
        if kind == "phase" and e.get("phase") == "startup" and not stage:
            mark("driver_running", float(e["end"]))
        elif kind == "stage_result":
            mark(f"{e['outcome'].get('stage')}_done", float(e["ts"]))
            if e["outcome"].get("stage") == "data_prep":
                probe = e["outcome"].get("artifacts", {}).get("ladder", {})
                if isinstance(probe.get("seconds"), int | float):
                    at["ladder_probe_s"] = round(float(probe["seconds"]), 2)
        elif kind == "fleet" and e.get("action") == "lighthouse_started":
            mark("lighthouse_up", float(e["ts"]))
        elif kind == "log" and str(e.get("message", "")).startswith("decontamination:"):
            mark("dedup_decontam_done", float(e["ts"]))
    mark("first_step", first)
    return at


def _figures(events: list[dict[str, Any]], accepted_at: float) -> dict[str, Any]:
    steps = [e for e in events if e.get("kind") == "step" and e.get("committed")]
    first = min((e["ts"] for e in steps), default=None)
    by_phase: dict[str, list[float]] = {}
    for e in steps:
        by_phase.setdefault(e.get("phase", ""), []).append(float(e["ts"]))
    order = sorted(by_phase, key=lambda p: min(by_phase[p]))
    switches = [min(by_phase[b]) - max(by_phase[a]) for a, b in itertools.pairwise(order)]
    return {
        "accept_to_first_step_s": round(first - accepted_at, 2) if first else None,
        "phase_switch_s_max": round(max(switches), 2) if switches else None,
        "phases": order,
        "phase_switch_s": [round(s, 2) for s in switches],
        "startup_spans": _spans(events, accepted_at, first),
    }


def run_preset(
    preset: str,
    var_dir: Path,
    max_steps: int | None = None,
    ladder_tokens: int | None = None,
    post_training: bool = False,
) -> dict[str, Any]:
    if var_dir.exists():
        ray_cluster.stop_local_head(var_dir / "server")
        shutil.rmtree(var_dir)
    var_dir.mkdir(parents=True)
    # By default without the demo's post-training recipe: these figures are the
    # pretraining pipeline's (phase switches, and a driver that must not grow with the
    # model).
    setup = demo.prepare(var_dir, preset=preset, post_training=post_training)
    db, env, port, manifest = setup.db, setup.env, setup.port, setup.manifest
    # A shorter run of the same pipeline (the CI smoke size).
    doc = json.loads(manifest.read_text())
    if max_steps is not None:
        doc["training"]["max_steps"] = max_steps
        doc["training"]["warmup_steps"] = min(doc["training"]["warmup_steps"], max_steps // 2)
    if ladder_tokens is not None:
        probe = doc["data"]["ladder_probe"]
        probe.update({"enabled": False} if ladder_tokens == 0 else {"token_budget": ladder_tokens})
    manifest.write_text(json.dumps(doc, indent=2))

    server = start_server(env, db, var_dir, port)
    sampler = _RssSampler(ray_cluster.ray_temp_dir(var_dir / "server"))
    sampler.start()
    try:
        sub_env = {**env, "ITO_API_KEY": setup.submitter}
        run_id = demo.confirm_and_train(setup, f"bench-{uuid.uuid4().hex[:12]}")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        state = "queued"
        while time.monotonic() < deadline:
            state = _state(db, run_id)
            if state in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(POLL_S)
        m = run_cli(["ito", "metrics", "--run", run_id, "--json"], sub_env)["data"]
        events = _events(db, run_id)
        out = {
            "preset": preset,
            "state": state,
            "goodput": m.get("goodput"),
            **_figures(events, _accepted_at(db, run_id)),
            "eval_share": round(m["badput_s"].get("evaluation", 0.0) / m["elapsed_s"], 4)
            if m.get("elapsed_s")
            else None,
            "badput_share": {
                cause: round(s / m["elapsed_s"], 4) for cause, s in m["badput_s"].items()
            }
            if m.get("elapsed_s")
            else None,
            "elapsed_s": round(m.get("elapsed_s", 0.0), 1),
            "ladder": _ladder(events),
        }
    finally:
        sampler.stop.set()
        sampler.join(timeout=5)
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        ray_cluster.stop_local_head(var_dir / "server")
    out["driver_peak_rss_mb"] = round(sampler.peak_kb / 1024, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["llama-tiny", "llama-small"],
        help="model presets, smaller first (growth: last over first)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="override the demo's 200 steps (the CI smoke size)",
    )
    parser.add_argument(
        "--ladder-tokens",
        type=int,
        default=None,
        help="override the demo's ladder-probe token budget per proxy; 0 turns the "
        "probe off (the CI smoke size)",
    )
    parser.add_argument(
        "--post-training",
        action="store_true",
        help="keep the demo's post-training recipe (SFT -> DPO -> RLVR): the demo's whole run",
    )
    parser.add_argument(
        "--var-dir", type=Path, default=Path(tempfile.gettempdir()) / "ito-bench-pipeline"
    )
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    for preset in args.presets:
        try:
            results.append(
                run_preset(
                    preset,
                    args.var_dir.resolve() / preset,
                    args.max_steps,
                    args.ladder_tokens,
                    args.post_training,
                )
            )
        except (Exception, SystemExit) as e:  # one preset's failure still reports the other
            results.append(
                {
                    "preset": preset,
                    "state": "error",
                    "error": str(e)[:300],
                    "driver_peak_rss_mb": None,
                }
            )
    small, large = results[0], results[-1]
    growth = (
        large["driver_peak_rss_mb"] / small["driver_peak_rss_mb"]
        if small["driver_peak_rss_mb"] and large["driver_peak_rss_mb"]
        else None
    )
    print(
        json.dumps({"presets": results, "driver_rss_growth": round(growth, 3) if growth else None}),
        flush=True,
    )
    return 0 if all(r["state"] == "succeeded" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
