"""``python -m stages.parallelism --model PRESET --gpu SKU --gpus-per-node N --nodes M
--fabric FABRIC --global-batch-tokens T [--seq-len S] --json``

Prints the plan or the refusal in the envelope every ito command uses. Exit 0 on a
plan, 2 on a refusal. Without ``--json`` a short human summary is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from stages.errors import ErrorCode, ItoError
from stages.parallelism.planner import validate_layout
from stages.parallelism.search import plan
from stages.parallelism.spec import Layout, PlanRequest

NOTICE = "local planner: predictions from a memory and throughput model; nothing was booked"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stages.parallelism", description=__doc__)
    p.add_argument("--model", required=True, help="configs/models preset, e.g. llama3-8b")
    p.add_argument("--gpu", required=True, help="configs/gpus SKU, e.g. H100-SXM")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--fabric", required=True, help="configs/fabrics name, e.g. ib-ndr")
    p.add_argument("--global-batch-tokens", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp8"], default="auto")
    p.add_argument("--mfu-floor", type=float, default=None)
    p.add_argument(
        "--min-replica-groups",
        type=int,
        default=1,
        help="torchft replica groups the plan must have",
    )
    p.add_argument(
        "--layout",
        default=None,
        help="check hand-set degrees instead of searching, as JSON, e.g. "
        '\'{"tp": 8, "pp": 2, "dp_shard": -1}\'',
    )
    p.add_argument("--json", action="store_true", help="print the JSON envelope")
    return p


def run(argv: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    args = _parser().parse_args(argv)
    try:
        request = PlanRequest(
            model=args.model,
            gpu_sku=args.gpu,
            gpus_per_node=args.gpus_per_node,
            node_count=args.nodes,
            fabric=args.fabric,
            global_batch_tokens=args.global_batch_tokens,
            seq_len=args.seq_len,
            precision=args.precision,
            mfu_floor=args.mfu_floor,
            min_replica_groups=args.min_replica_groups,
        )
        if args.layout:
            result = validate_layout(request, Layout.model_validate_json(args.layout))
        else:
            result = plan(request)
    except ItoError as err:
        return 2, {
            "ok": False,
            "live_api_contacted": False,
            "notice": NOTICE,
            "error": {"code": str(err.code), "message": err.message, "details": err.details},
        }
    except ValidationError as err:
        return 2, {
            "ok": False,
            "live_api_contacted": False,
            "notice": NOTICE,
            "error": {
                "code": str(ErrorCode.validation_error),
                "message": str(err.errors()[0]["msg"]),
            },
        }
    return 0, {
        "ok": True,
        "live_api_contacted": False,
        "notice": NOTICE,
        "data": result.model_dump(),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    code, envelope = run(args)
    if "--json" in args:
        print(json.dumps(envelope, indent=2))
    elif envelope["ok"]:
        d = envelope["data"]
        print(
            f"tp {d['tp']} pp {d['pp']} ({d['pp_schedule']}) cp {d['cp']} dp_shard "
            f"{d['dp_shard']} dp_replicate {d['dp_replicate']} micro-batch {d['micro_batch']}"
            f" x{d['grad_accum']} ac {d['activation_checkpointing']} {d['precision']}: "
            f"{d['peak_memory_gib']:.1f} GiB, MFU {d['mfu']:.1%}, sync "
            + (
                f"DiLoCo every {d['sync']['sync_every']} steps"
                if d["sync"]["mode"] == "diloco"
                else "every step"
            )
        )
        for reason in d["reasons"]:
            print(f"  - {reason}")
    else:
        print(f"refused: {envelope['error']['code']}: {envelope['error']['message']}")
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head: stop quietly, like other CLIs
        sys.stderr.close()
        sys.exit(1)
