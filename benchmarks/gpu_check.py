"""GPU check: does the trainer keep the planner's promises on one CUDA GPU?

    .venv/bin/python benchmarks/gpu_check.py [--steps 30] [--seq-len 2048] [--micro-batch 4]

Trains the ``llama-1b`` preset (random init) through the trainer's own layout code
(``stages.trainer.parallel.parallelize.ParallelModel``: bf16 under autocast with fp32 master
weights; fp8 through torchao's float8 training) for a few dozen steps in bf16 and
then in fp8, and prints next to each the planner's prediction for the same layout
(``validate_layout``, one GPU, same micro-batch, sequence and recompute):

* tokens/s: tokens trained per second over the timed steps (the first
  ``--warmup`` steps, which include kernel selection and torchao's set-up, are
  excluded), measured with ``torch.cuda.synchronize`` around the timed window;
* MFU: tokens/s x the model FLOPs per token that the planner uses (torchtitan's
  ``6 (N - embedding) + 12 L h s``) / the dense peak of the precision used, from
  ``configs/gpus/<SKU>.json``: the planner's own definition, so the two compare;
* peak GiB: ``torch.cuda.max_memory_allocated`` over the run (tensors, as the
  planner's memory model counts them; the allocator's cache is not included).

Then a two-phase curriculum run on CUDA through the training stage itself (a local
Ray, one torchft replica group, ``llama-tiny``, pretrain @64 then long_context @128
tokens, each phase closed by the ``smoke`` battery on the trainer rank): it reports
whether both gates ran, the phase switch (last step of phase 1 -> first step of
phase 2, the gate included) and the eval seconds (``two_phase`` in the JSON line).

Then the SFT objective (one step) on the engine's CUDA rank (trained, exported and
scored there) and the RLVR objective (one step) with its rollout worker on the GPU,
through the post-training stage.

The three parts (``layout``, ``two_phase``, ``post_training``) run on their own
(``--only PART``, repeatable): a part that raises is reported as that part's
``error`` and the others still run. Ends with one JSON line keyed by part:
``layout`` holds ``bf16_mfu``, ``fp8_mfu``, ``predicted_mfu`` (bf16),
``predicted_fp8_mfu``, ``peak_gib`` and ``predicted_peak_gib`` (bf16) and the layout;
``ok`` is false (and the exit status 1) when any part failed. Runs unattended in well
under 5 minutes on an H100 (two runs of ~30 steps of a 1.2B model). Where no CUDA GPU
exists it prints why and exits with status 2; where fp8 cannot run (no torchao, below
SM 9.0) the fp8 figures are null.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NO_GPU_EXIT = 2
# The check's local Ray advertises this many GPU slots over the one physical device and
# is told not to set CUDA_VISIBLE_DEVICES, so every actor's cuda:0 is that device: the
# RLVR learner rank and its rollout worker share it, as a colocated one-GPU deployment
# does (on a booking each gets a GPU of its own).
GPU_SLOTS = 4
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
PRESET = "llama-1b"
# Name fragments of torch.cuda.get_device_name() -> configs/gpus SKU.
SKUS = (
    ("H200", "H200"),
    ("H100 PCIe", "H100-PCIe"),
    ("H100", "H100-SXM"),
    ("B200", "B200"),
    ("A100", "A100-80G"),
    ("L40S", "L40S"),
)


def sku_of(name: str) -> str | None:
    return next((sku for frag, sku in SKUS if frag in name), None)


def predict(sku: str, precision: str, micro_batch: int, seq_len: int) -> dict[str, Any]:
    from stages.errors import ItoError
    from stages.parallelism import PlanRequest
    from stages.parallelism.planner import validate_layout
    from stages.parallelism.spec import Layout

    req = PlanRequest(
        model=PRESET,
        gpu_sku=sku,
        gpus_per_node=1,
        node_count=1,
        fabric="loopback",
        global_batch_tokens=micro_batch * seq_len,
        seq_len=seq_len,
        precision=precision,  # type: ignore[arg-type]
        mfu_floor=0.0,
    )
    try:
        p = validate_layout(req, Layout(micro_batch=micro_batch, dp_shard=1, precision=precision))  # type: ignore[arg-type]
    except ItoError as e:
        return {"refused": e.code.value, "reason": e.message}
    return {"mfu": p.mfu, "tokens_per_s": p.tokens_per_s, "peak_gib": p.peak_memory_gib}


def train(
    precision: str, *, steps: int, warmup: int, micro_batch: int, seq_len: int, peak_tflops: float
) -> dict[str, Any]:
    import torch

    from stages.errors import ItoError
    from stages.model.lm import build_model
    from stages.parallelism.throughput import model_flops_per_token
    from stages.presets import load_model_preset
    from stages.trainer.parallel.layout import ParallelLayout
    from stages.trainer.parallel.parallelize import ParallelModel
    from stages.trainer.rank.objective import LanguageModelObjective

    LM = LanguageModelObjective(loader=None)  # batches are given, not read
    device = torch.device("cuda", 0)
    preset = load_model_preset(PRESET)
    torch.cuda.reset_peak_memory_stats(device)
    model = build_model(preset, seed=0).to(device)  # type: ignore[arg-type]  # transformers stubs
    try:
        pm = ParallelModel(
            model,
            ParallelLayout(precision=precision),  # type: ignore[arg-type]
            None,
            device,
        )
    except ItoError as e:
        return {"skipped": e.code.value, "reason": e.message}
    opt = torch.optim.AdamW(pm.module.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, preset.vocab_size, (micro_batch, seq_len), device=device, generator=g)
    losses = []
    t0 = 0.0
    for step in range(steps):
        if step == warmup:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        loss = pm.forward_backward(LanguageModelObjective.batch_of(ids), LM)
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    tokens_per_s = (steps - warmup) * micro_batch * seq_len / elapsed
    mfu = tokens_per_s * model_flops_per_token(preset, seq_len) / (peak_tflops * 1e12)
    out = {
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
        "built": pm.built_layout(),
    }
    del pm, model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def two_phase_run(work: Path) -> dict[str, Any]:
    """A two-phase run with an eval battery at each phase end, on CUDA."""
    import tempfile

    import ray

    from stages.base import StageContext
    from stages.curriculum.config import CurriculumConfig
    from stages.curriculum.schedule import schedule_curriculum
    from stages.events import EvalEvent, Event, PhaseEvent, StepEvent
    from stages.trainer import TrainingStage
    from stages.trainer.config import TrainStageConfig

    data = work / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": f"doc {i}: " + "the quick brown fox " * (i % 7 + 1)}) + "\n"
            for i in range(400)
        )
    )
    curriculum = CurriculumConfig.model_validate(
        {
            "phases": [
                {
                    "name": "pretrain",
                    "kind": "pretrain",
                    "token_fraction": 0.5,
                    "seq_len": 64,
                    "gates": [{"metric": "heldout_loss", "max": 100.0}],
                },
                {
                    "name": "long",
                    "kind": "long_context",
                    "token_fraction": 0.5,
                    "seq_len": 128,
                    "gates": [{"metric": "heldout_loss", "max": 100.0}],
                },
            ]
        }
    )
    schedule = schedule_curriculum(
        curriculum,
        total_steps=40,
        base_seq_len=64,
        global_batch_tokens=2048,
        learning_rate=3e-3,
        warmup_steps=5,
        rope_theta=10000.0,
        head_dim=16,
        max_positions=256,
    )
    cfg = TrainStageConfig.model_validate(
        {
            "model": {"preset": "llama-tiny", "size": "0.1M"},
            "target": {"max_steps": 40, "seq_len": 64, "global_batch_tokens": 2048},
            "checkpoint": {"interval_steps": 10, "keep": 2, "storage_uri": f"file://{work}/ckpt"},
            "train_files": [str(data)],
            "replica_groups": 1,
            "device": "cuda",
            "worker_num_cpus": 1,
            "curriculum": schedule.model_dump(mode="json"),
        }
    )
    events: list[Event] = []
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=GPU_SLOTS,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ray-gpucheck-"),
        log_to_driver=False,
    )
    try:
        (work / "run").mkdir(exist_ok=True)
        ctx = StageContext(
            run_id="gpucheck", booking_id="bk", workdir=work / "run", emit=events.append
        )
        out = TrainingStage(cfg).run(ctx)
    finally:
        ray.shutdown()
    steps = [e for e in events if isinstance(e, StepEvent) and e.committed]
    ends = {
        p.name: max((e.ts for e in steps if e.phase == p.name), default=None)
        for p in schedule.phases
    }
    starts = {
        p.name: min((e.ts for e in steps if e.phase == p.name), default=None)
        for p in schedule.phases
    }
    first, second = (p.name for p in schedule.phases)
    a, b = ends[first], starts[second]
    switch = b - a if a is not None and b is not None else None
    evals = [e for e in events if isinstance(e, EvalEvent)]
    return {
        "status": out.status,
        "reason": out.reason,
        "gated_phases": sorted({e.phase for e in evals}),
        "phase_switch_s": round(switch, 2) if switch is not None else None,
        "eval_s": round(
            sum(
                e.end - e.start
                for e in events
                if isinstance(e, PhaseEvent) and e.phase == "evaluation"
            ),
            2,
        ),
        "steps": len({e.step for e in steps}),
    }


def post_training_run(work: Path) -> dict[str, Any]:
    """The SFT objective (one step) on the engine's CUDA rank, then the RLVR objective
    (one step) with its rollout worker on the GPU, through the post-training stage
    itself (tiny random policy, synthetic verifiable task; a local Ray with the one
    GPU)."""
    import tempfile

    import ray

    from stages.base import StageContext
    from stages.data_prep.refs import is_data
    from stages.events import Event, StepEvent
    from stages.post_training import PostTrainingStage, PostTrainingStageConfig
    from stages.post_training.synthetic import build_tiny_policy, write_task
    from stages.snapshot import path_digest

    policy = build_tiny_policy(work / "policy")
    task = write_task(work / "task")

    def ref(path: Path) -> dict[str, Any]:
        return {
            "uri": f"file://{path}",
            "sha256": path_digest(path, include=is_data),
            "provenance": {"source": "synthetic", "license": "MIT"},
        }

    recipe = {
        "base_model": f"file://{policy}",
        "base_model_sha256": path_digest(policy),
        "sft": {"data": ref(task["sft"]), "steps": 1, "learning_rate": 5e-3, "gate": None},
        "rlvr": {
            "data": ref(task["rlvr"]),
            "steps": 1,
            "reward": "first_number_match",
            "group_size": 4,
            "groups_per_step": 1,
            "max_completion_tokens": 4,
            "overlong_buffer_tokens": 1,
            "gate": None,
        },
    }
    stage = PostTrainingStage(
        PostTrainingStageConfig.model_validate(
            {
                "recipe": recipe,
                "output_dir": str(work / "out"),
                "fleet": "ray",
                "device": "cuda",
                "data_roots": (str(work),),
                "model_roots": (str(work),),
            }
        )
    )
    events: list[Event] = []
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=GPU_SLOTS,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ray-gpucheck-pt-"),
        log_to_driver=False,
    )
    t0 = time.time()
    try:
        (work / "run").mkdir(exist_ok=True)
        ctx = StageContext(
            run_id="gpucheck-pt", booking_id="bk", workdir=work / "run", emit=events.append
        )
        out = stage.run(ctx)
    finally:
        ray.shutdown()
    sft = [e for e in events if isinstance(e, StepEvent) and e.committed and e.phase == "sft"]
    return {
        "status": out.status,
        "reason": out.reason,
        "sft_steps": len({e.step for e in sft}),
        "sft_nll_before": out.metrics.get("sft_nll_before"),
        "sft_nll_after": out.metrics.get("sft_nll_after"),
        "rlvr_steps": out.metrics.get("rlvr_steps"),
        "seconds": round(time.time() - t0, 2),
    }


def layout_run(args: argparse.Namespace) -> dict[str, Any]:
    """bf16 and fp8 training of ``PRESET`` beside the planner's prediction."""
    import torch

    from stages.parallelism.hardware import load_gpu_sku

    name = torch.cuda.get_device_name(0)
    sku_name = sku_of(name) or "H100-SXM"
    if sku_of(name) is None:
        print(f"gpu_check: {name} has no configs/gpus profile; predicting as H100-SXM")
    sku = load_gpu_sku(sku_name)
    shape = {"micro_batch": args.micro_batch, "seq_len": args.seq_len}
    results: dict[str, dict[str, Any]] = {}
    for precision in ("bf16", "fp8"):
        peak = sku.peak_tflops(precision) if precision == "bf16" or sku.supports_fp8 else 0.0
        measured = train(
            precision,
            steps=args.steps,
            warmup=args.warmup,
            peak_tflops=peak or sku.peak_tflops("bf16"),
            **shape,
        )
        predicted = predict(sku_name, precision, **shape)
        results[precision] = {"measured": measured, "predicted": predicted}
        print(f"{precision}: measured {json.dumps(measured, default=str)}", flush=True)
        print(f"{precision}: predicted {json.dumps(predicted)}", flush=True)
    b, f = results["bf16"], results["fp8"]
    return {
        "sku": sku_name,
        "model": PRESET,
        **shape,
        "bf16_mfu": b["measured"].get("mfu"),
        "fp8_mfu": f["measured"].get("mfu"),
        "predicted_mfu": b["predicted"].get("mfu"),
        "predicted_fp8_mfu": f["predicted"].get("mfu"),
        "peak_gib": b["measured"].get("peak_gib"),
        "predicted_peak_gib": b["predicted"].get("peak_gib"),
        "bf16_tokens_per_s": b["measured"].get("tokens_per_s"),
        "predicted_tokens_per_s": b["predicted"].get("tokens_per_s"),
        "fp8_tokens_per_s": f["measured"].get("tokens_per_s"),
        "fp8_skipped": f["measured"].get("skipped"),
    }


PARTS = ("layout", "two_phase", "post_training")


def run_part(name: str, fn: Any, *fn_args: Any) -> dict[str, Any]:
    """One part's result; an exception is reported as the part's ``error`` (the
    check runs unattended, so one broken part must not hide the others' figures)."""
    import traceback

    t0 = time.time()
    try:
        out = dict(fn(*fn_args))
    except Exception as e:  # reported, and the exit status says so
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    out["part_s"] = round(time.time() - t0, 2)
    print(f"{name}: {json.dumps(out, default=str)}", flush=True)
    return out


def part_ok(name: str, out: dict[str, Any]) -> bool:
    if "error" in out:
        return False
    return name == "layout" or out.get("status") == "passed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        default=None,
        help="run only this part (repeatable); default: every part",
    )
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); "
            "nothing measured. Run it on a GPU node of a booking.",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    import tempfile

    from orchestrator.runtime.launch import use_scratch_launch_key

    os.environ.setdefault(NOSET_CUDA_VISIBLE_DEVICES, "1")
    parts = args.only or list(PARTS)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        use_scratch_launch_key(root)  # run by hand, no server holds one
        if "layout" in parts:
            results["layout"] = run_part("layout", layout_run, args)
        for name, fn in (("two_phase", two_phase_run), ("post_training", post_training_run)):
            if name in parts:
                (root / name).mkdir()
                results[name] = run_part(name, fn, root / name)
    ok = all(part_ok(n, results[n]) for n in parts)
    print(json.dumps({**results, "gpu": torch.cuda.get_device_name(0), "ok": ok}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
