"""Slow-fabric benchmark (CI: smallest size only): the same model for the same tokens,
synchronously and with the planner's DiLoCo choice, over a throttled link between the
two replica groups.

1. The link (``benchmarks/netem_link.py``, root only): two network namespaces, one a
   node each, joined by a veth pair shaped to ``--rate-mbit`` and ``--delay-ms`` one way
   (``tc netem``; a kernel without netem gets a token bucket, ``tbf``, for the rate and
   the link's own latency, and says so). Each node reaches the host (the Ray head and
   the driver, on the host) over its own unshaped veth: only traffic between the
   groups is throttled, not Ray's or the lighthouse's to the driver. A TCP probe
   measures the link both ways, a node's host link and loopback (which must stay
   fast: other Ray clusters of the machine talk there), and is printed.
   A Ray cluster: a head on the host (no CPUs) and one raylet per namespace at the
   node's address; the run's placement group takes one bundle per node, so replica
   group 0 trains on one node and group 1 on the other (``bundle_for_rank``), and the
   run's lighthouse sits on group 0's node (bundle 0, as in production): group 1's
   quorum calls cross the slow link, as they would between two halls. The ranks'
   gloo binds the node's address (``gloo_on_cluster_address``), so the gradient and
   pseudo-gradient allreduces cross it too. Each group's ranks are pinned to their own
   core (``pin_group_cores``). Without root (or ``ip``/``tc``), the reason is printed
   and both runs go on one local Ray, unthrottled: the harness runs, the figures mean
   nothing.
2. The planner (``stages.parallelism.plan``) on the ``cpu-testbed`` SKU as a core
   measured it, two nodes of one rank, ``min_replica_groups=2``, the run's batch and
   sequence length, and the measured link as its fabric (``Fabric``: the probe's
   slower direction as bandwidth, ``efficiency`` 1 since it is already an achieved
   rate, half the probe's round trip as latency), the run's step count as a step H
   must divide (the phase end). Its ``Plan.sync`` is what the second run trains
   with (``--sync-every`` pins H, as a manifest may: the planner honours and explains
   it); ``step_time_by_sync`` gives its predicted step time of each mode. The same
   request on the ``loopback`` fabric (the unthrottled testbed) must keep
   ``every_step``.

   The device, measured like the link: the catalogue's ``cpu-testbed`` prices a
   shared core (its TFLOP/s were fitted on a loaded host), and a quiet core trains
   about 3x faster. So before the runs a plain loop (``benchmarks/throughput.py``'s:
   forward, backward and AdamW of the model on one group's share of the batch, no
   communication, one thread on group 0's core) times ``--calibration-steps`` steps
   after two warm-up steps, and the planner gets the SKU at that rate
   (``measured_sku``: its compute and memory rates scaled by the planner's
   prediction of that same one-device step over the measured). What the prediction
   then checks is the planner's model of the link and of DiLoCo's amortised sync,
   and the engine's own overheads per step (the JSON's ``calibration``: the measured
   step, the catalogue's prediction of it, and the rate scale given the planner).
3. Two runs of the real training stage, ``--preset`` on ``data/python_docs`` for
   ``--steps`` steps of ``--batch-tokens`` tokens (identical tokens: same data, seed
   and schedule), one curriculum phase whose end runs the ``smoke`` battery (the
   engine's own held-out check, ``stages.evals.heldout``, on the run's held-out split:
   the same documents for both runs): ``sync.mode="every_step"``, then the planner's
   ``sync``. Per run:

   - ``train_wall_s``: from the start of group 0's first step (its commit time minus
     its seconds) to its last step's commit; start-up and the phase-end battery are
     left out (the same for both), ``run_wall_s`` counts them;
   - ``tokens_per_s``: the run's tokens (steps x batch) over ``train_wall_s``;
   - ``step_s``: the measured mean step after the first (its one-time warm-up left
     out; DiLoCo's syncs amortised over its inner steps), beside the planner's
     ``predicted_step_s`` of that mode and ``predicted_ratio``, predicted / measured
     (the bar: 0.7 .. 1.3);
   - ``median_step_s``: the median gap between group 0's consecutive steps (DiLoCo: an
     inner step without its sync);
   - ``heldout_loss``: mean next-token nats of the final weights on the held-out split;
   - ``link_mb``: megabytes the shaped link carried during the run (both directions);
   - ``lone_steps``: group 0's steps committed without group 1 (it missed the quorum).

   Ratios, DiLoCo over sync: ``wall_ratio`` (the bar: <= 0.5) and ``loss_ratio`` (the
   bar: <= 1.03). ``allreduce_share``: 1 - DiLoCo's median inner step / the sync run's
   median step, the share of a synchronous step the per-step allreduce took (the
   benchmark's premise: >= 0.6 at the default size).

Ends with one JSON line. Timings on a shared, loaded machine are noisy (the load
average is printed).

    .venv/bin/python benchmarks/slow_fabric.py                 # ~4 min
    .venv/bin/python benchmarks/slow_fabric.py --smoke         # CI's size
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks import netem_link
from benchmarks.fault_tolerance import Watcher
from benchmarks.throughput import run_plain
from stages.base import GateOutcome, StageContext
from stages.checkpointing.config import CheckpointPolicy
from stages.curriculum.config import CurriculumConfig, CurriculumPhase
from stages.curriculum.schedule import schedule_curriculum
from stages.events import EvalEvent
from stages.parallelism.hardware import Fabric, GpuSku, load_gpu_sku, measured_sku
from stages.presets import load_model_preset
from stages.replica_sync import ReplicaSync
from stages.run_facts import PlacementFact, RunFacts
from stages.trainer.config import ModelSpec, TrainingTarget, TrainStageConfig

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "python_docs" / "train.jsonl"
# The whole run, start-up and phase-end battery included, must end within this.
RUN_TIMEOUT_S = 900.0
# A run that reports no step for this long (start-up and the phase-end battery take
# well under it) is stuck: it is cancelled and the benchmark says where it stopped.
STALL_TIMEOUT_S = 180.0
# The check of the smoke battery that scores the held-out split.
HELDOUT_CHECK = "heldout_loss"
# The bars of the issue this benchmark measures.
MAX_WALL_RATIO = 0.5
MAX_LOSS_RATIO = 1.03
PREDICTION_BAND = (0.7, 1.3)
SMOKE = {
    "preset": "llama-tiny",
    "steps": 4,
    "seq_len": 32,
    "batch_tokens": 256,
    "sync_every": 2,
    "calibration_steps": 2,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama-small", help="configs/models preset")
    p.add_argument("--steps", type=int, default=60, help="optimizer (inner) steps of each run")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=1024, help="global batch tokens")
    p.add_argument("--lr", type=float, default=1e-3, help="inner (AdamW) peak learning rate")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="the link's rate, Mbit/s")
    p.add_argument("--delay-ms", type=float, default=0.5, help="one-way delay (netem only)")
    p.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="pin DiLoCo's H (a manifest's pin, which the planner honours); default: "
        "the planner chooses the mode and H from the measured link",
    )
    p.add_argument("--outer-lr", type=float, default=None, help="pin DiLoCo's outer lr")
    p.add_argument(
        "--outer-momentum", type=float, default=None, help="pin DiLoCo's outer Nesterov momentum"
    )
    p.add_argument(
        "--calibration-steps",
        type=int,
        default=10,
        help="steps of the plain loop that measures the device's compute (after 2 warm-up)",
    )
    p.add_argument("--smoke", action="store_true", help=f"CI's smallest size: {SMOKE}")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.batch_tokens % args.seq_len or (args.batch_tokens // args.seq_len) % 2:
        p.error("--batch-tokens must be whole sequences of --seq-len, split over 2 groups")
    if args.steps < 2:
        p.error("--steps must be >= 2")
    return args


# --- the planner -------------------------------------------------------------------------
def planned(
    args: argparse.Namespace, fabric: str | Fabric, sku: GpuSku, *, pin_sync: bool = True
) -> Any:
    """The planner's plan of the runs' shape on ``fabric`` and ``sku`` (with
    ``--sync-every``'s pin when ``pin_sync``)."""
    from stages.parallelism import PlanRequest, plan

    pin = None
    if pin_sync and args.sync_every is not None:
        pin = ReplicaSync(mode="diloco", sync_every=args.sync_every)
    return plan(
        PlanRequest(
            model=args.preset,
            gpu_sku=sku,
            gpus_per_node=1,
            node_count=2,
            fabric=fabric,
            global_batch_tokens=args.batch_tokens,
            seq_len=args.seq_len,
            min_replica_groups=2,
            sync=pin,
            sync_divides=[args.steps],
        )
    )


def measured_device(args: argparse.Namespace, tmp: Path) -> tuple[GpuSku, dict[str, float]]:
    """The ``cpu-testbed`` SKU at the rate one pinned core trains the model now (see the
    module docstring), and the calibration's figures."""
    from stages.parallelism import PlanRequest, plan

    testbed = load_gpu_sku("cpu-testbed")
    core = sorted(os.sched_getaffinity(0))[0]  # group 0's (``pin_group_cores``)
    cfg = {
        "core": core,
        "preset": args.preset,
        "lr": args.lr,
        "seq_len": args.seq_len,
        "tokens": args.batch_tokens // 2,
        "warmup": 2,
        "measure": args.calibration_steps,
        "every": args.calibration_steps + 3,  # no checkpoint: the runs save none mid-run
        "ckpt": str(tmp / "calibration.pt"),
    }
    measured = run_plain(cfg)
    one_device = plan(
        PlanRequest(
            model=args.preset,
            gpu_sku=testbed,
            gpus_per_node=1,
            node_count=1,
            fabric="loopback",
            global_batch_tokens=args.batch_tokens // 2,
            seq_len=args.seq_len,
        )
    )
    sku = measured_sku(testbed, one_device.step_time_s, measured)
    return sku, {
        "measured_step_s": measured,
        "catalogue_step_s": one_device.step_time_s,
        "rate_scale": one_device.step_time_s / measured,
    }


def measured_fabric(probes: dict[str, netem_link.Probe] | None, args: argparse.Namespace) -> Fabric:
    """The link as the planner's fabric: what the probe measured (the slower direction,
    an achieved rate: efficiency 1), or the asked-for figures when nothing was."""
    if probes is None:
        mbit, rtt_ms, what = args.rate_mbit, 2 * args.delay_ms, "asked for, not measured"
    else:
        one_way = [probes["a_to_b"], probes["b_to_a"]]
        mbit = min(p.mbit_s for p in one_way)
        rtt_ms = statistics.median(p.rtt_ms for p in one_way)
        what = "measured by the probe"
    return Fabric(
        name="throttled-link",
        description=f"the benchmark's link between two groups ({what})",
        inter_node_bandwidth_gb_s_per_gpu=mbit / 8e3,
        latency_us=rtt_ms * 1e3 / 2,
        efficiency=1.0,
    )


# --- one run -------------------------------------------------------------------------------
def stage_config(args: argparse.Namespace, sync: ReplicaSync, ckpt: Path) -> TrainStageConfig:
    preset = load_model_preset(args.preset)
    heads = preset.num_attention_heads
    schedule = schedule_curriculum(
        CurriculumConfig(
            phases=[CurriculumPhase(name="pretrain", kind="pretrain", token_fraction=1)]
        ),
        total_steps=args.steps,
        base_seq_len=args.seq_len,
        global_batch_tokens=args.batch_tokens,
        learning_rate=args.lr,
        warmup_steps=min(10, args.steps // 4),
        head_dim=preset.hidden_size // heads,
        max_positions=preset.max_position_embeddings,
    )
    return TrainStageConfig.model_validate(
        dict(
            model=ModelSpec(preset=args.preset, size="bench"),
            target=TrainingTarget(
                max_steps=args.steps,
                seq_len=args.seq_len,
                global_batch_tokens=args.batch_tokens,
                learning_rate=args.lr,
                warmup_steps=min(10, args.steps // 4),
            ),
            # One save, at the end (a multiple of any H the planner may choose).
            checkpoint=CheckpointPolicy(
                interval_steps=args.steps, keep=1, storage_uri=f"file://{ckpt}"
            ),
            loss_spike={"enabled": False},  # a proposal would pause the run for a human
            replica_groups=2,
            spare_groups=0,
            train_files=[str(DATA)],
            curriculum=schedule,
            # lm-eval's checks of the battery on one item each: only the held-out
            # check is read here.
            evals={"limit": 1},
            sync=sync,
        ),
        strict=False,
    )


def placement_fact(nodes: int) -> PlacementFact:
    """A placement group of one bundle per worker node, as the orchestrator reserves a
    booking's nodes (``docs/placement.md``), for the stage's ``placement`` fact."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": 1.0, netem_link.NODE_RESOURCE: 1.0}
    name = f"slow-fabric-{os.getpid()}-{time.time_ns()}"
    pg = placement_group([bundle] * nodes, strategy="STRICT_SPREAD", name=name)
    ray.get(pg.ready(), timeout=120)
    return PlacementFact(
        booking_id="bench",
        resource=netem_link.NODE_RESOURCE,
        placement_group=name,
        placement_group_id=pg.id.hex(),
        bundles=nodes,
        bundle=bundle,
    )


def train(
    args: argparse.Namespace, mode: str, sync: ReplicaSync, tmp: Path, facts: RunFacts
) -> dict[str, Any]:
    """One run to its end; its figures (see the module docstring)."""
    cfg = stage_config(args, sync, tmp / f"ckpt-{mode}")
    w = Watcher()
    run_id = f"sf{os.getpid()}{mode.replace('_', '')}"
    ctx = StageContext(
        run_id=run_id, booking_id="bench", workdir=tmp / run_id, emit=w.emit, facts=facts
    )
    ctx.workdir.mkdir(parents=True)
    from stages.trainer import TrainingStage

    outcome: list[GateOutcome] = []
    t0 = time.time()
    thread = threading.Thread(target=lambda: outcome.append(TrainingStage(cfg).run(ctx)))
    thread.start()
    while thread.is_alive():
        thread.join(1.0)
        now = time.time()
        last_step = max((e.ts for e in w.steps()), default=t0)
        if thread.is_alive() and (now - t0 > RUN_TIMEOUT_S or now - last_step > STALL_TIMEOUT_S):
            ctx.cancel_event.set()
            thread.join(60)
            raise TimeoutError(
                f"the {mode} run stopped at step {w.max_step()} of {args.steps}: no step for "
                f"{now - last_step:.0f}s, {now - t0:.0f}s in all"
            )
    run_wall = time.time() - t0
    if not outcome or not outcome[0].passed:
        raise RuntimeError(f"the {mode} run failed: {outcome[0] if outcome else 'no outcome'}")
    steps = {e.step: e for e in sorted(w.steps(), key=lambda e: e.ts) if e.replica_group == 0}
    first, last = steps[min(steps)], steps[max(steps)]
    # The first step's start: its report's time less its own seconds (a merged report's
    # seconds are its steps' sum).
    train_wall = last.ts - (first.ts - first.seconds)
    n = args.steps
    # The steady step: the first step's one-time work (kernels, the optimizer's lazy
    # state) left out; DiLoCo's syncs all fall after it.
    step_s = (last.ts - first.ts) / (last.step - first.step)
    gaps = [steps[s].ts - steps[s - 1].ts for s in sorted(steps) if s - 1 in steps]
    [held] = [e for e in w.events if isinstance(e, EvalEvent) and e.check == HELDOUT_CHECK]
    assert held.score is not None
    return {
        "sync": sync.model_dump(mode="json"),
        "steps": n,
        "tokens": n * args.batch_tokens,
        "train_wall_s": train_wall,
        "run_wall_s": run_wall,
        "tokens_per_s": n * args.batch_tokens / train_wall,
        "step_s": step_s,
        "median_step_s": statistics.median(gaps) if gaps else train_wall / n,
        # Steps group 0 committed without the other group (it missed the quorum, e.g.
        # behind by more than the join timeout on a loaded host): such a step trains
        # one share and moves no bytes over the link, so the runs differ more.
        "lone_steps": sum(1 for e in steps.values() if e.quorum_size < cfg.replica_groups),
        "final_train_loss": last.loss,
        "heldout_loss": held.score,
    }


# --- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    from orchestrator.runtime.launch import use_scratch_launch_key

    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="ito-slowfab-"))
    use_scratch_launch_key(tmp)  # run by hand, no server holds one: ranks inherit it
    skip = netem_link.unavailable_reason()
    if skip is None:  # the cluster's nodes check tokens (read when Ray is imported)
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    link: netem_link.NetemLink | None = None
    cluster: netem_link.TwoNodeRay | None = None
    out: dict[str, Any] = {"throttled": skip is None}
    try:
        probes = None
        facts = RunFacts()  # no placement: Ray schedules the ranks as it likes
        # Before any cluster starts: the core trains alone, as the groups' will.
        sku, calibration = measured_device(args, tmp)
        out["calibration"] = calibration
        c = calibration
        print(
            f"device: a pinned core trains one group's share in {c['measured_step_s']:.3f}s "
            f"(the cpu-testbed catalogue: {c['catalogue_step_s']:.3f}s): the planner gets "
            f"its rates x{c['rate_scale']:.2f}",
            flush=True,
        )
        if skip is None:
            link = netem_link.NetemLink(rate_mbit=args.rate_mbit, delay_ms=args.delay_ms)
            link.open()
            assert link.reaper is not None
            link.reaper.note("dir", str(tmp))
            print(f"link: {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way, shaped by "
                  f"{link.shaper}", flush=True)  # fmt: skip
            probes = link.probes()
            for name, pr in probes.items():
                print(f"probe {name}: {pr.line()}", flush=True)
            out["probes"] = {k: {"rtt_ms": v.rtt_ms, "mbit_s": v.mbit_s} for k, v in probes.items()}
            out["shaper"] = link.shaper
            cluster = netem_link.TwoNodeRay(link, tmp)
            t0 = time.time()
            cluster.start()
            print(f"ray: a head on the host, a node in each namespace, up in "
                  f"{time.time() - t0:.1f}s", flush=True)  # fmt: skip
            ray.init(address=cluster.address, log_to_driver=False)
            facts = RunFacts(placement=placement_fact(2))
        else:
            print(f"no throttled link: {skip}; both runs on one local Ray, unthrottled "
                  "(the figures below mean nothing)", flush=True)  # fmt: skip
            ray.init(address="local", num_cpus=4, include_dashboard=False,
                     _temp_dir=str(tmp / "ray"), log_to_driver=False)  # fmt: skip

        fabric = measured_fabric(probes, args)
        slow = planned(args, fabric, sku)
        fast = planned(args, "loopback", sku, pin_sync=False)
        predicted = {k: round(v, 3) for k, v in slow.step_time_by_sync.items()}
        print(f"planner, {fabric.inter_node_bandwidth_gb_s_per_gpu * 8e3:.0f} Mbit/s link: "
              f"{slow.sync.mode} (H={slow.sync.sync_every}); predicted step s {predicted}",
              flush=True)  # fmt: skip
        for reason in slow.reasons:
            if "sync" in reason.lower() or "diloco" in reason.lower():
                print(f"  planner: {reason}", flush=True)
        print(f"planner, unthrottled loopback: {fast.sync.mode} (predicted step "
              f"{fast.step_time_s:.3f}s)", flush=True)  # fmt: skip
        out["planned_sync"] = slow.sync.model_dump(mode="json")
        out["loopback_sync"] = fast.sync.mode
        out["loopback_keeps_every_step"] = fast.sync.every_step

        diloco = slow.sync
        outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
        pinned = {k: v for k, v in outer.items() if v is not None}
        if pinned and not diloco.every_step:  # validated as the manifest's would be
            diloco = ReplicaSync.model_validate({**diloco.model_dump(), **pinned})
        runs = {"sync": ReplicaSync(), "diloco": diloco}
        for name, sync in runs.items():
            sent = link.shaped_bytes() if link is not None else 0
            r = train(args, name, sync, tmp, facts)
            # What crossed the slow link: the groups' allreduces (and group 1's quorum
            # calls to the lighthouse on group 0's node), both directions.
            r["link_mb"] = (link.shaped_bytes() - sent) / 1e6 if link is not None else None
            predicted = slow.step_time_by_sync.get(sync.mode)
            r["predicted_step_s"] = predicted
            r["predicted_ratio"] = predicted / r["step_s"] if predicted else None
            out[name] = r
            print(
                f"{name} ({sync.mode}, H={sync.sync_every}): train {r['train_wall_s']:.1f}s "
                f"(run {r['run_wall_s']:.1f}s), {r['tokens_per_s']:.0f} tokens/s, step "
                f"{r['step_s']:.3f}s (median {r['median_step_s']:.3f}s) vs predicted "
                f"{_two(predicted, 3)}s, held-out loss {r['heldout_loss']:.4f}; "
                f"{_two(r['link_mb'], 0)} MB over the slow link, {r['lone_steps']} steps "
                "without the other group",
                flush=True,
            )
    finally:
        with_ray = ray.is_initialized()
        if with_ray:
            ray.shutdown()
        if cluster is not None:
            cluster.stop()
        if link is not None:
            link.close()
        shutil.rmtree(tmp, ignore_errors=True)

    s, d = out["sync"], out["diloco"]
    out["wall_ratio"] = d["train_wall_s"] / s["train_wall_s"]
    out["loss_ratio"] = d["heldout_loss"] / s["heldout_loss"]
    out["allreduce_share"] = 1 - d["median_step_s"] / s["median_step_s"]
    lo, hi = PREDICTION_BAND
    out["bars"] = {
        "wall_ratio<=0.5": out["wall_ratio"] <= MAX_WALL_RATIO,
        "loss_ratio<=1.03": out["loss_ratio"] <= MAX_LOSS_RATIO,
        "sync_prediction_in_band": bool(s["predicted_ratio"] and lo <= s["predicted_ratio"] <= hi),
        "diloco_prediction_in_band": bool(
            d["predicted_ratio"] and lo <= d["predicted_ratio"] <= hi
        ),
        "loopback_keeps_every_step": out["loopback_keeps_every_step"],
    }
    print(
        f"DiLoCo / sync: wall {out['wall_ratio']:.2f} (bar <= {MAX_WALL_RATIO}), held-out loss "
        f"{out['loss_ratio']:.3f} (bar <= {MAX_LOSS_RATIO}); the sync step's allreduce share "
        f"{out['allreduce_share']:.2f}; predicted / measured step (bar "
        f"{PREDICTION_BAND[0]}..{PREDICTION_BAND[1]}): sync {_two(s['predicted_ratio'])}, "
        f"diloco {_two(d['predicted_ratio'])}",
        flush=True,
    )
    summary = {
        **_rounded(out),
        "preset": args.preset,
        "batch_tokens": args.batch_tokens,
        "seq_len": args.seq_len,
        "rate_mbit": args.rate_mbit,
        "delay_ms": args.delay_ms,
        "wall_s": round(time.time() - t_start, 1),
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)
    return summary


def _two(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return v


if __name__ == "__main__":
    main()
