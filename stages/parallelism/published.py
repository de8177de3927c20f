"""The planner against published training runs.

    python -m stages.parallelism.published [--json]

For each run below (its layout, batch and hardware as the source gives them) it
prints the planner's own pick for the same request, and the planner's verdict and
predictions for the published layout next to the published figures: the table in
docs/planner.md. Settings a source does not give (Meta's pipeline schedule, chunks
and recompute) are the fastest the planner accepts for the published degrees; when
it accepts none, the variant nearest to fitting (least memory) is shown with its
refusal. Predictions on a refused layout come from the same model with the bounds
lifted, so a refusal still shows how far off it is.

Sources:

* Llama 3 paper ("The Llama 3 Herd of Models", 2024), table 4: Llama 3 405B on H100
  80 GB over RoCE, 16M-token batches, BF16 MFU. No memory figure is published
  (the runs fit 80 GB).
* torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Dec 2024): Llama 3.1
  on Grand Teton H100s (96 GB HBM2e, 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU),
  TPS/GPU and peak GiB. Micro-batches: torchtitan's default, one per PP stage;
  interleaved 1F1B: two chunks a rank (torchtitan's default then).
* torchtitan ``benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md``: Llama 3.1 8B
  on 4 x 8 H200 over 400 Gb/s RDMA, FSDP, compiled float8.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from stages.errors import ItoError
from stages.parallelism.checks import Context
from stages.parallelism.hardware import GpuSku, load_fabric, load_gpu_sku
from stages.parallelism.planner import evaluate
from stages.parallelism.search import plan_context
from stages.parallelism.spec import (
    ActivationCheckpointing,
    Layout,
    PipelineSchedule,
    Plan,
    PlanRequest,
)
from stages.replica_sync import ReplicaSync

# torchtitan's benchmark hosts: H100 with 96 GB HBM2e at 2.4 TB/s and a 500 W limit.
# Their dense peak at 500 W is not published (torchtitan divides by the SXM's), so
# the SXM's peaks are used and predictions for these rows lean optimistic.
GRAND_TETON_H100 = GpuSku(
    name="H100-96G-HBM2e-500W",
    description="H100 96 GB HBM2e, 500 W (Grand Teton), as torchtitan benchmarked",
    memory_gib=96,
    bf16_tflops=989,
    fp8_tflops=1979,
    hbm_bandwidth_gb_s=2400,
    intra_node_link="nvlink",
    nvlink_domain=8,
    intra_node_bandwidth_gb_s=450,
)
# The schedules and recompute tried for a published layout that does not name them.
SCHEDULES: tuple[tuple[PipelineSchedule, int], ...] = (
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("Interleaved1F1B", 4),
    ("Interleaved1F1B", 8),
)
RECOMPUTE: tuple[ActivationCheckpointing, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class PublishedRun:
    source: str
    model: str  # configs/models preset
    sku: str  # configs/gpus name, or GRAND_TETON_H100's name
    nodes: int
    fabric: str
    seq_len: int
    global_batch_tokens: int
    tp: int
    pp: int
    cp: int
    dp_shard: int
    precision: str
    micro_batch: int = 1
    schedule: PipelineSchedule | None = None  # None: not published
    virtual_stages: int | None = None
    recompute: ActivationCheckpointing | None = None
    tokens_per_gpu_s: float | None = None
    mfu: float | None = None  # published BF16 MFU
    memory_gib: float | None = None


M = 2**20
LLAMA3 = "Llama 3 paper, table 4"
TITAN = "torchtitan Dec 2024"
RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        LLAMA3,
        "llama3-405b",
        "H100-SXM",
        1024,
        "roce",
        8192,
        16 * M,
        8,
        16,
        1,
        64,
        "bf16",
        mfu=0.43,
    ),
    PublishedRun(
        LLAMA3,
        "llama3-405b",
        "H100-SXM",
        2048,
        "roce",
        8192,
        16 * M,
        8,
        16,
        1,
        128,
        "bf16",
        mfu=0.41,
    ),
    PublishedRun(
        LLAMA3,
        "llama3.1-405b",
        "H100-SXM",
        2048,
        "roce",
        131072,
        16 * M,
        8,
        16,
        16,
        8,
        "bf16",
        mfu=0.38,
    ),
    PublishedRun(
        TITAN + " table 1",
        "llama3.1-8b",
        GRAND_TETON_H100.name,
        1,
        "roce",
        8192,
        16 * 8192,
        1,
        1,
        1,
        8,
        "bf16",
        2,
        recompute="selective",
        tokens_per_gpu_s=5762,
        memory_gib=82.4,
    ),
    PublishedRun(
        TITAN + " table 1",
        "llama3.1-8b",
        GRAND_TETON_H100.name,
        1,
        "roce",
        8192,
        16 * 8192,
        1,
        1,
        1,
        8,
        "fp8",
        2,
        recompute="selective",
        tokens_per_gpu_s=8532,
        memory_gib=76.8,
    ),
    PublishedRun(
        TITAN + " table 3",
        "llama3.1-8b",
        GRAND_TETON_H100.name,
        16,
        "roce",
        8192,
        256 * 8192,
        1,
        1,
        1,
        128,
        "bf16",
        2,
        recompute="selective",
        tokens_per_gpu_s=5605,
        memory_gib=67.0,
    ),
    PublishedRun(
        TITAN + " table 3",
        "llama3.1-8b",
        GRAND_TETON_H100.name,
        16,
        "roce",
        8192,
        256 * 8192,
        1,
        1,
        1,
        128,
        "fp8",
        2,
        recompute="selective",
        tokens_per_gpu_s=8380,
        memory_gib=61.8,
    ),
    PublishedRun(
        TITAN + " table 4, async TP",
        "llama3-70b",
        GRAND_TETON_H100.name,
        32,
        "roce",
        8192,
        512 * 8192,
        8,
        1,
        1,
        32,
        "fp8",
        16,
        recompute="full",
        tokens_per_gpu_s=876,
        memory_gib=67.6,
    ),
    PublishedRun(
        TITAN + " table 5",
        "llama3-405b",
        GRAND_TETON_H100.name,
        64,
        "roce",
        8192,
        256 * 8192,
        8,
        8,
        1,
        8,
        "fp8",
        4,
        "1F1B",
        1,
        "full",
        tokens_per_gpu_s=100,
        memory_gib=82.5,
    ),
    PublishedRun(
        TITAN + " table 5",
        "llama3-405b",
        GRAND_TETON_H100.name,
        64,
        "roce",
        8192,
        256 * 8192,
        8,
        8,
        1,
        8,
        "fp8",
        4,
        "Interleaved1F1B",
        2,
        "full",
        tokens_per_gpu_s=128,
        memory_gib=72.7,
    ),
    PublishedRun(
        TITAN + " table 6",
        "llama3.1-405b",
        GRAND_TETON_H100.name,
        64,
        "roce",
        32768,
        64 * 32768,
        8,
        8,
        1,
        8,
        "fp8",
        1,
        "1F1B",
        1,
        "full",
        tokens_per_gpu_s=76,
        memory_gib=75.3,
    ),
    PublishedRun(
        "torchtitan H200 (Trainy)",
        "llama3.1-8b",
        "H200",
        4,
        "ib-ndr",
        8192,
        64 * 8192,
        1,
        1,
        1,
        32,
        "fp8",
        2,
        recompute="selective",
        tokens_per_gpu_s=10938,
        memory_gib=47.96,
    ),
)


def _sku(name: str) -> GpuSku:
    return GRAND_TETON_H100 if name == GRAND_TETON_H100.name else load_gpu_sku(name)


def context(run: PublishedRun, precision: str = "auto") -> Context:
    """The planner's resolved request for the run's model, metal and batch."""
    request = PlanRequest(
        model=run.model,
        gpu_sku=run.sku,
        gpus_per_node=8,
        node_count=run.nodes,
        fabric=run.fabric,
        global_batch_tokens=run.global_batch_tokens,
        seq_len=run.seq_len,
        precision=precision,  # type: ignore[arg-type]
        sync=ReplicaSync(),  # the published runs synced every step
    )
    return Context(request, request.preset(), _sku(run.sku), load_fabric(run.fabric), run.seq_len)


def _unbounded(ctx: Context) -> Context:
    """The same request with every model-based bound lifted: predictions only."""
    request = ctx.request.model_copy(
        update={"memory_utilization": 1.0, "max_pp_bubble": 0.99, "mfu_floor": 0.0}
    )
    sku = ctx.sku.model_copy(update={"memory_gib": 1e9})
    return Context(request, ctx.preset, sku, ctx.fabric, ctx.seq_len)


def published_layouts(run: PublishedRun) -> list[Layout]:
    """The published degrees with each schedule / recompute the source leaves open."""
    schedules = (
        [(run.schedule, run.virtual_stages or 1)]
        if run.schedule
        else (SCHEDULES if run.pp > 1 else SCHEDULES[:1])
    )
    return [
        Layout(
            tp=run.tp,
            pp=run.pp,
            cp=run.cp,
            dp_shard=run.dp_shard,
            micro_batch=run.micro_batch,
            pp_schedule=schedule,
            pp_virtual_stages=virtual,
            activation_checkpointing=ac,
            precision=run.precision,  # type: ignore[arg-type]
        )
        for schedule, virtual in schedules
        for ac in ([run.recompute] if run.recompute else RECOMPUTE)
    ]


@dataclass(frozen=True)
class Verdict:
    layout: Layout
    refusal: ItoError | None  # None: accepted
    prediction: Plan | None  # the model's figures, bounds lifted; None: structurally refused


def assess_published(run: PublishedRun) -> Verdict:
    """The fastest accepted variant of the published layout, else the one nearest to
    fitting (least predicted memory), with its refusal."""
    ctx = context(run, run.precision)
    free = _unbounded(ctx)
    verdicts: list[Verdict] = []
    for layout in published_layouts(run):
        try:
            prediction: Plan | None = evaluate(free, layout, explain=False)
        except ItoError as e:
            verdicts.append(Verdict(layout, e, None))
            continue
        try:
            evaluate(ctx, layout, explain=False)
            verdicts.append(Verdict(layout, None, prediction))
        except ItoError as e:
            verdicts.append(Verdict(layout, e, prediction))
    accepted = [v for v in verdicts if v.refusal is None and v.prediction]
    if accepted:
        return max(accepted, key=lambda v: v.prediction.tokens_per_s if v.prediction else 0.0)
    predicted = [v for v in verdicts if v.prediction]
    if predicted:
        return min(predicted, key=lambda v: v.prediction.peak_memory_gib if v.prediction else 0.0)
    return verdicts[0]


def _degrees(tp: int, cp: int, pp: int, dp: int, rep: int = 1) -> str:
    return f"TP{tp} CP{cp} PP{pp} FSDP{dp}" + (f" x{rep} replicas" if rep > 1 else "")


def _pick(run: PublishedRun, precision: str) -> str:
    try:
        p = plan_context(context(run, precision))
    except ItoError as e:
        return f"refused: `{e.code.value}`"
    sched = "" if p.pp == 1 else f" {p.pp_schedule}x{p.pp_virtual_stages}"
    return (
        f"{_degrees(p.tp, p.cp, p.pp, p.dp_shard, p.dp_replicate)}{sched} mb{p.micro_batch} "
        f"{p.activation_checkpointing} {p.precision}: {p.peak_memory_gib:.1f} GiB, "
        f"MFU {p.mfu:.1%}, {p.tokens_per_s / p.world_size:,.0f} tok/s/GPU"
    )


def row(run: PublishedRun) -> dict[str, Any]:
    v = assess_published(run)
    lay, pred = v.layout, v.prediction
    gpus = 8 * run.nodes
    pick, auto = _pick(run, run.precision), _pick(run, "auto")
    return {
        "source": run.source,
        "model": run.model,
        "gpus": gpus,
        "hardware": f"{run.sku}, {run.fabric}",
        "seq_len": run.seq_len,
        "published": _degrees(run.tp, run.cp, run.pp, run.dp_shard)
        + f" mb{run.micro_batch} {run.precision}"
        + (f" {run.schedule}x{run.virtual_stages}" if run.schedule else "")
        + (f" {run.recompute}" if run.recompute else ""),
        "pick": pick,
        "pick_auto": "same" if auto == pick else auto,
        "settings": (f"{lay.pp_schedule}x{lay.pp_virtual_stages} " if lay.pp > 1 else "")
        + lay.activation_checkpointing,
        "verdict": "accepted" if v.refusal is None else f"`{v.refusal.code.value}`",
        "refusal": None if v.refusal is None else v.refusal.message,
        "predicted_gib": None if pred is None else pred.peak_memory_gib,
        "published_gib": run.memory_gib,
        "predicted_mfu": None if pred is None else pred.mfu,
        "published_mfu": run.mfu,
        "predicted_tokens_per_gpu_s": None if pred is None else pred.tokens_per_s / gpus,
        "published_tokens_per_gpu_s": run.tokens_per_gpu_s,
    }


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| source | model, GPUs, seq | published layout | planner's pick (published "
        "precision) | pick with `auto` precision | published layout: verdict (settings) | "
        "peak GiB predicted / published | MFU predicted / published | tok/s/GPU "
        "predicted / published |\n|---|---|---|---|---|---|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['model']}, {r['gpus']:,} x {r['hardware']}, "
            f"{r['seq_len']:,} | {r['published']} | {r['pick']} | {r['pick_auto']} | "
            f"{r['verdict']} ({r['settings']}) | {_num(r['predicted_gib'], '.1f')} / "
            f"{_num(r['published_gib'], '.1f')} | {_num(r['predicted_mfu'], '.1%')} / "
            f"{_num(r['published_mfu'], '.0%')} | "
            f"{_num(r['predicted_tokens_per_gpu_s'], ',.0f')} / "
            f"{_num(r['published_tokens_per_gpu_s'], ',.0f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.parallelism.published")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args(argv)
    rows = [row(run) for run in RUNS]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
