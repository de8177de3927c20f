"""Planner benchmark: plan time from 8 to 16,384 GPUs, and the plans it picks.

    .venv/bin/python benchmarks/planner.py [--quick]

Prints a timing table (goal: under 1 s per plan), then the plans for Llama-3-shaped
8B, 70B and 405B models on 8 x H100-SXM nodes over InfiniBand NDR at 1, 8, 64 and
1,024 nodes (predicted peak memory and MFU, or the refusal) once with automatic
precision (fp8 where it pays) and once forced to bf16 (to compare with published
bf16 MFU), and ends with one JSON line: {"max_plan_s": ..., "plans": [rows]}.

Global batches follow Llama 3 practice at 8,192-token sequences: 4M tokens for 8B,
8M for 70B, 16M for 405B (Llama 3 405B ramped 4M -> 8M -> 16M).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.errors import ItoError
from stages.parallelism import Plan, PlanRequest, plan

MODELS = {"llama3-8b": 4 * 2**20, "llama3-70b": 8 * 2**20, "llama3-405b": 16 * 2**20}
TABLE_NODES = (1, 8, 64, 1024)
TIMING_GPUS = (8, 64, 512, 4096, 16384)
SEQ_LEN = 8192


def _request(model: str, nodes: int, precision: str = "auto") -> PlanRequest:
    return PlanRequest(
        model=model,
        gpu_sku="H100-SXM",
        gpus_per_node=8,
        node_count=nodes,
        fabric="ib-ndr",
        global_batch_tokens=MODELS[model],
        seq_len=SEQ_LEN,
        precision=precision,  # type: ignore[arg-type]
    )


def _timed(request: PlanRequest) -> tuple[float, Plan | ItoError]:
    start = time.perf_counter()
    try:
        result: Plan | ItoError = plan(request)
    except ItoError as err:
        result = err
    return time.perf_counter() - start, result


def _row(
    model: str, nodes: int, precision: str, seconds: float, result: Plan | ItoError
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": model,
        "nodes": nodes,
        "gpus": nodes * 8,
        "precision_request": precision,
        "global_batch_tokens": MODELS[model],
        "plan_s": round(seconds, 3),
    }
    if isinstance(result, ItoError):
        row["refusal"] = str(result.code)
        return row
    row.update(
        tp=result.tp,
        pp=result.pp,
        pp_schedule=result.pp_schedule,
        pp_virtual_stages=result.pp_virtual_stages,
        cp=result.cp,
        dp_shard=result.dp_shard,
        dp_replicate=result.dp_replicate,
        micro_batch=result.micro_batch,
        grad_accum=result.grad_accum,
        activation_checkpointing=result.activation_checkpointing,
        precision=result.precision,
        peak_memory_gib=round(result.peak_memory_gib, 1),
        mfu=result.mfu,
        tokens_per_s_per_gpu=round(result.tokens_per_s / result.world_size),
    )
    return row


def _markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | nodes | TP | PP (schedule x chunks) | CP | FSDP | replicas | micro-batch x "
        "accum | recompute | precision | peak GiB | MFU | tok/s/GPU | plan s |",
        "|---|---:|---:|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "refusal" in r:
            out.append(
                f"| {r['model']} | {r['nodes']} | refused: `{r['refusal']}` "
                f"| | | | | | | | | | | {r['plan_s']} |"
            )
            continue
        pp = f"{r['pp']}" + (
            f" ({r['pp_schedule']} x{r['pp_virtual_stages']})" if r["pp"] > 1 else ""
        )
        out.append(
            f"| {r['model']} | {r['nodes']} | {r['tp']} | {pp} | {r['cp']} | "
            f"{r['dp_shard']} | {r['dp_replicate']} | {r['micro_batch']} x "
            f"{r['grad_accum']} | {r['activation_checkpointing']} | {r['precision']} | "
            f"{r['peak_memory_gib']} | {r['mfu']:.1%} | {r['tokens_per_s_per_gpu']} | "
            f"{r['plan_s']} |"
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="timing up to 512 GPUs only")
    args = parser.parse_args()
    gpus_list = [g for g in TIMING_GPUS if not args.quick or g <= 512]
    max_s = 0.0
    print("plan time (s), 8 GPUs per node:")
    print(f"{'GPUs':>6} " + " ".join(f"{m:>12}" for m in MODELS))
    for gpus in gpus_list:
        times = []
        for model in MODELS:
            seconds, _ = _timed(_request(model, gpus // 8))
            times.append(seconds)
            max_s = max(max_s, seconds)
        print(f"{gpus:>6} " + " ".join(f"{t:>12.3f}" for t in times))
    rows = []
    for precision in ("auto", "bf16"):
        table = []
        for model in MODELS:
            for nodes in TABLE_NODES:
                seconds, result = _timed(_request(model, nodes, precision))
                max_s = max(max_s, seconds)
                table.append(_row(model, nodes, precision, seconds, result))
        print(f"\nprecision {precision} (MFU against the dense peak of the precision used):")
        print(_markdown(table))
        rows += table
    print(json.dumps({"max_plan_s": round(max_s, 3), "plans": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
