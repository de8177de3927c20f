"""Every script in benchmarks/ runs at its smallest size and ends with its JSON line,
so none rots unnoticed. The figures themselves are not checked (a smoke size on a
shared machine measures nothing); their keys are, since docs and READMEs quote them.
``gpu_check.py`` needs a CUDA GPU: without one it must exit 2 and say why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.postgres import PgServer
from helpers.xdist_groups import ray_local_group

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
# A hang guard per script, never a speed claim. Serial on a shared 2-core machine the
# Ray smokes took: post_training.py ~120 s, pipeline.py ~110 s, fault_tolerance.py
# ~90 s, quorum_stability.py ~45 s, data_prep_scale.py ~40 s, slow_fabric.py 110-180 s
# (three raylets and two runs; over 200 s each for the first two under heavy load).
BENCH_TIMEOUT_S = 480
NO_GPU_EXIT = 2

# The Ray smokes that join the session's local Ray (the ``ray_local`` fixture, up since
# the first module on it) with ``--ray-address``, instead of each starting and stopping
# a Ray of its own (10-40 s each on the loaded testbed; joining takes a second). Their
# workers read the session's launch key (tests/conftest.py) from its environment and
# import the repo from the smoke's folder (Ray adds it to its job's workers). The
# others keep their own: data_prep_scale.py runs each size in a fresh process with a
# fresh Ray (its RSS counted per process), pipeline.py the server with its embedded
# head, slow_fabric.py a head and two raylets in network namespaces.
SHARED_RAY = {
    "post_training.py",
    "quorum_stability.py",
    "throughput.py",
    "elastic.py",
    "fault_tolerance.py",
}

# script -> (smallest-size arguments, keys its last JSON line must carry, needs Ray)
CASES: dict[str, tuple[list[str], set[str], bool]] = {
    "api_load.py": (
        ["--clients", "2", "--duration", "1", "--submits", "2"],
        {
            "clients",
            "status_p50_ms",
            "status_p99_ms",
            "submit_p99_ms",
            "status_service_p99_ms",
            "submit_service_p99_ms",
            "requests_per_s",
            "errors",
        },
        False,
    ),
    "checkpoint.py": (
        ["--state-mb", "4", "--tensor-mb", "1", "--repeats", "1", "--step-s", "0"],
        {
            "state_mb",
            "sync_save_s",
            "async_block_s",
            "block_ratio",
            "ckpt_mb_per_s",
            "disk_mb_per_s",
            "bandwidth_ratio",
            "staging",
            "checkpoint_bytes",
        },
        False,
    ),
    "data_prep.py": (
        ["--docs", "300", "--baseline-docs", "100"],
        {
            "docs",
            "dedup_docs_per_s",
            "baseline_docs_per_s",
            "speedup",
            "precision",
            "recall",
            "decontam_mb_per_s",
        },
        False,
    ),
    "planner.py": (["--quick"], {"max_plan_s", "plans"}, False),
    "data_prep_scale.py": (
        ["--sizes", "2000", "--baseline-sizes", "2000", "--block-docs", "1000"],
        {
            "docs",
            "docs_per_s",
            "peak_rss_mb",
            "rss_growth",
            "precision",
            "recall",
            "baseline_docs",
            "baseline_docs_per_s",
        },
        True,
    ),
    "post_training.py": (
        [
            "--steps",
            "2",
            "--workers",
            "1",
            "--groups",
            "1",
            "--group-size",
            "2",
            "--max-tokens",
            "4",
            "--hidden",
            "16",
            "--learner-steps",
            "2",
            "--learner-groups",
            "2",
            # One drop a step still takes dynamic sampling's path; the random policy's
            # groups are nearly all uniform, and each drop is one more generation.
            "--max-dropped-groups",
            "1",
        ],
        {
            "eta0_idle_frac",
            "eta2_idle_frac",
            "idle_ratio",
            "eta0_samples_per_s",
            "eta2_samples_per_s",
            "sync_s_median",
            "sync_s_median_object_store",
            "sync_s_median_collective",
            "resume_s",
            "learner_groups",
            "learner_tokens_per_s",
        },
        True,
    ),
    "pipeline.py": (
        # A probe of two steps a proxy: its proxies train on the warming ranks.
        ["--presets", "llama-tiny", "--max-steps", "8", "--ladder-tokens", "1024"],
        {"presets", "driver_rss_growth"},
        True,
    ),
    "quorum_stability.py": (
        # Counted from the first full quorum on, for a second: the figures are not read.
        ["--heartbeat-ms", "1000", "--duration", "1", "--settle-s", "0", "--burners", "1"],
        {"burners", "groups", "results"},
        True,
    ),
    "throughput.py": (
        # One size, one step measured, one 1.5 s window with one kill (at 1 s): a
        # longer window only waits, on both sides.
        [
            "--presets",
            "llama-tiny",
            "--warmup-steps",
            "1",
            "--measure-steps",
            "1",
            "--rounds",
            "1",
            "--checkpoint-every",
            "2",
            "--fail-every",
            "1",
            "--window-s",
            "1.5",
        ],
        {"results", "groups", "batch_tokens", "checkpoint_every", "wall_s", "load_avg_1m"},
        True,
    ),
    "elastic.py": (
        # Ours only: Ray Train's elastic half waits out its autoscaling coordinator's
        # 20 s tick and a 60 s worker-group start timeout (minutes); its training
        # function is fault_tolerance.py's Ray Train peer, which runs below. One step
        # before the grow, one timed step (one gap) for each rate, counted from the
        # resize's applied step.
        [
            "--ray-train",
            "0",
            "--spares",
            "0",
            "--warmup-steps",
            "1",
            "--measure-steps",
            "1",
            "--settle-steps",
            "0",
        ],
        {
            "grow_s",
            "shrink_s",
            "tokens_per_s_before",
            "tokens_per_s_after_grow",
            "tokens_per_s_after_shrink",
            "grow_ratio",
            "shrink_ratio",
            "wall_s",
            "load_avg_1m_after",
        },
        True,
    ),
    "slow_fabric.py": (
        # llama-tiny, 4 steps a run, DiLoCo pinned to H = 2 (the planner honours it):
        # the link, its probe, the planner and both runs, not their figures.
        ["--smoke"],
        {
            "throttled",
            "calibration",
            "planned_sync",
            "loopback_keeps_every_step",
            "sync",
            "diloco",
            "wall_ratio",
            "loss_ratio",
            "allreduce_share",
            "bars",
            "wall_s",
        },
        True,
    ),
    "fault_tolerance.py": (
        [
            "--kills",
            "1",
            "--restart-kills",
            "1",
            "--spares",
            "0",
            "--kill-steps",
            "1",
            "--checkpoint-every",
            "2",
            "--warmup-steps",
            "2",
            "--settle-steps",
            "1",
            "--ray-train-kills",
            "1",
        ],
        {
            "kills",
            "detect_s_median",
            "resume_s_median",
            "ft_lost_token_s_median",
            "restart_lost_token_s_median",
            "checkpoint_every",
            "restart_kills",
            "tokens_per_s",
            "wall_s",
            "ray_train_kills",
            "ray_train_restart_s_median",
            "ray_train_lost_token_s_median",
            "lost_ratio_tokens_ray_train",
        },
        True,
    ),
}


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
    )


def _last_json(stdout: str) -> dict[str, Any]:
    lines = [li for li in stdout.splitlines() if li.strip()]
    assert lines, "no output"
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def test_every_benchmark_has_a_smoke_case() -> None:
    # A script runs as __main__; a module without that guard is a part of one (the
    # Ray Train baseline is fault_tolerance.py's).
    scripts = {p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert scripts == {*CASES, "gpu_check.py"}
    assert "ray_train_baseline.py" not in scripts


# Every script may take up to its hang guard; pytest's own guard stands behind it.
pytestmark = pytest.mark.timeout(BENCH_TIMEOUT_S + 60)


def _cases() -> list[Any]:
    def marks(script: str, ray: bool) -> list[pytest.MarkDecorator]:
        if script in SHARED_RAY:  # under xdist, on the worker whose session Ray they join
            return [pytest.mark.slow, ray_local_group(__name__)]
        return [pytest.mark.slow] if ray else []

    return [
        pytest.param(script, id=script, marks=marks(script, ray))
        for script, (_, _, ray) in CASES.items()
    ]


@pytest.fixture
def ray_address(request: pytest.FixtureRequest) -> str | None:
    """Where a SHARED_RAY smoke joins the session's local Ray (None: another smoke)."""
    if request.node.callspec.params["script"] not in SHARED_RAY:
        return None
    request.getfixturevalue("ray_local")
    import ray

    return str(ray.get_runtime_context().gcs_address)


@pytest.mark.parametrize("script", _cases())
def test_benchmark_runs_at_its_smallest_size(script: str, ray_address: str | None) -> None:
    args, keys, _ = CASES[script]
    if ray_address is not None:
        args = [*args, "--ray-address", ray_address]
    proc = _run(script, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert keys <= set(out), sorted(keys - set(out))
    if script in SHARED_RAY:  # it ran as a job of the session's Ray, not on a Ray of its own
        from ray._private import state

        assert any(str(BENCH / script) in job["Entrypoint"] for job in state.jobs())
    if script == "pipeline.py":  # the run's probe trained on its own ranks
        [run] = out["presets"]
        assert run["ladder"]["trained_on"] == ["rg0/rank0", "rg1/rank0"], run["ladder"]
    if script == "throughput.py":  # each side measured, each failure window on both
        [size] = out["results"]
        sides = {
            f"{s}_{k}"
            for s in ("engine", "ray_train", "plain")
            for k in ("step_ms", "tokens_per_s")
        }
        assert sides | {"step_efficiency", "plain_efficiency"} <= set(size), sorted(size)
        assert len(size["step_efficiency_rounds"]) == out["rounds"] == 1, size
        assert set(size["goodput_tokens_per_s"]["1"]) >= {"engine", "ray_train", "ratio"}
    if script == "slow_fabric.py":  # the planner's choice flips with the fabric
        assert out["loopback_keeps_every_step"] is True, out["loopback_sync"]
        assert out["planned_sync"]["mode"] == "diloco", out["planned_sync"]
        for mode, run in (("every_step", out["sync"]), ("diloco", out["diloco"])):
            assert run["sync"]["mode"] == mode and run["heldout_loss"] > 0, run
            # Throttled (root): each group on its own end of the link, the allreduces over it.
            assert not out["throttled"] or run["link_mb"] > 0, run


def test_api_load_closed_mode_sweeps_both_stores_side_by_side(pg_server: PgServer) -> None:
    # Two concurrency steps per sweep, a submit every other request in the mix: the
    # smallest run that takes both sweeps, both stores and the ratio through.
    proc = _run(
        "api_load.py",
        *("--mode", "closed", "--replicas", "2", "--db", pg_server.new_database()),
        *("--sqlite-baseline", "--clients-max", "2", "--step-s", "0.3", "--warmup-s", "0.1"),
        *("--patience", "2", "--p99-bound-ms", "60000", "--submit-every", "2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert {"saturation_ratio", "mix_saturation_ratio", "sqlite", "replicas"} <= set(out)
    step_keys = {
        "clients",
        "requests_per_s",
        "status_per_s",
        "submit_per_s",
        "p50_ms",
        "p99_ms",
        "server_cpu_ms_per_request",
        "errors",
    }
    for name, replicas in (("sqlite", 1), ("replicas", 2)):
        store = out[name]
        assert store["replicas"] == replicas and store["errors"] == {}, store
        assert {"status_saturation_rps", "mix_saturation_rps"} <= set(store)
        for sweep in ("status", "mix"):
            steps = store[sweep]["steps"]
            assert [s["clients"] for s in steps] == [1, 2], steps
            assert all(step_keys <= set(s) for s in steps), steps
        # The mix submits; the reads-only sweep never does.
        assert sum(s["submit_per_s"] for s in store["mix"]["steps"]) > 0, store["mix"]
        assert sum(s["submit_per_s"] for s in store["status"]["steps"]) == 0


def test_gpu_check_without_a_gpu_exits_2_and_says_why() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: gpu_check measures instead")
    proc = _run("gpu_check.py", "--steps", "1")
    assert proc.returncode == NO_GPU_EXIT
    assert "no CUDA GPU" in proc.stderr and proc.stdout == ""


PINNED_THREADS = """
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from benchmarks.ray_train_baseline import pin_process
stop = threading.Event()
before = threading.Thread(target=stop.wait)  # made before the pin, as gloo's threads are
before.start()
core = sorted(os.sched_getaffinity(0))[0]
pin_process([core])
for tid in os.listdir("/proc/self/task"):
    print(sorted(os.sched_getaffinity(int(tid))) == [core])
stop.set()
before.join()
"""


def test_ray_train_worker_pins_every_thread_of_its_process() -> None:
    """The baseline's worker pins its whole process, threads made before the pin
    included (gloo's, made with the process group): pinning only the training thread
    left them free to use the other worker's core."""
    out = subprocess.run(
        [sys.executable, "-c", PINNED_THREADS, str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert len(out) >= 2 and set(out) == {"True"}, out


def test_throughput_rounds_alternate_the_sides_abba() -> None:
    """Each side goes first in every other round, so a drift of the machine's speed
    over the run is paid by both sides alike, not by the one measured second."""
    # In a child: the benchmark's import sets OMP_NUM_THREADS for what it launches.
    code = "import json; from benchmarks.throughput import round_order; "
    code += "print(json.dumps(round_order(4)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    order = [tuple(sides) for sides in json.loads(out.stdout)]
    assert order[0] == ("engine", "ray_train")
    assert [sides[::-1] for sides in order[::2]] == order[1::2]
    assert all(sorted(sides) == ["engine", "ray_train"] for sides in order)
