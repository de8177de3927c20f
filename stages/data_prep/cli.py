"""Command line for preparing data before booking.

    python -m stages.data_prep dedup --input PATH --output PATH [--json]
    python -m stages.data_prep decontaminate --input PATH --eval PATH... --output PATH [--json]

``--input`` is a file or a folder of jsonl/parquet/text (``--text-field``, default
"text"). Every input record is written out with all of its fields as given (a jsonl
line byte for byte); nothing is added except, with ``--action flag``, the field
``--flag-field`` (default "contaminated"; naming a field the records have is
refused). ``--output`` ending in ``.jsonl`` or ``.parquet`` is one file; any other
path is a folder of shards ``part-NNNNN.<format>`` (one per input block) with
``manifest.json`` (shards, sha256s). ``--output-format`` picks jsonl or parquet
(default: the suffix, else jsonl). The provenance record (input and output digests,
what was removed and why, with each document's "<ref>:<file>:<line>" id, and
``output_rows``: output row n -> its input document id) goes beside
it as ``<output>.provenance.json``. Eval files are jsonl with a text field named by
``--eval-field`` (default "question") or plain text, one item a line.

The work streams block by block (``--block-docs``) in this process, or on Ray Data
with ``--ray-address local|auto|HOST:PORT``; the result is the same. A run killed
midway resumes from its finished stages and blocks when started again with the same
arguments (work folder ``<output>.work``, or ``--work-dir``). Progress goes to stderr.
Exit status 0 on success, 2 on an error (printed with its stable code).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stages.data_prep.config import DecontaminationConfig, DedupConfig
from stages.data_prep.decontam import EvalIndex
from stages.data_prep.evals import EvalItem, load_eval_items
from stages.data_prep.records import write_json
from stages.data_prep.stream.blocks import input_files
from stages.data_prep.stream.config import StreamConfig
from stages.data_prep.stream.output import concat_shards, executor_for
from stages.data_prep.stream.provenance import decontam_section, dedup_section
from stages.data_prep.stream.run import Progress, StreamResult, run_stream
from stages.errors import ErrorCode, ItoError

# Seconds between progress lines on stderr (a new stage always prints one).
PROGRESS_INTERVAL_S = 10.0
SINGLE_FILE_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
# Up to this many output rows, the provenance record lists each row's input document id
# (``output_rows``); above, they go to ``<output>.rows.txt`` (``output_rows_path``).
OUTPUT_ROWS_INLINE_MAX = 1_000_000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m stages.data_prep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dedup", help="exact + MinHash-LSH near-duplicate removal")
    d.add_argument("--threshold", type=float, default=DedupConfig().threshold)
    d.add_argument("--num-perm", type=int, default=DedupConfig().num_perm)
    d.add_argument("--shingle-size", type=int, default=DedupConfig().shingle_size)
    c = sub.add_parser("decontaminate", help="remove or flag documents containing eval items")
    c.add_argument("--eval", nargs="+", default=[], metavar="PATH", help="eval files")
    c.add_argument(
        "--suite",
        action="append",
        default=[],
        help="also a registered eval suite (configs/evals/<suite>.json)",
    )
    c.add_argument("--eval-field", default="question")
    c.add_argument("--mode", choices=["ngram", "overlap"], default="ngram")
    c.add_argument("--ngram", type=int, default=DecontaminationConfig().ngram)
    c.add_argument("--overlap-ngram", type=int, default=DecontaminationConfig().overlap_ngram)
    c.add_argument(
        "--overlap-threshold", type=float, default=DecontaminationConfig().overlap_threshold
    )
    c.add_argument("--action", choices=["remove", "flag"], default="remove")
    c.add_argument(
        "--flag-field",
        default="contaminated",
        help="with --action flag: the field set to true on flagged records "
        "(naming a field the records already have is refused)",
    )
    for s in (d, c):
        s.add_argument("--input", required=True, type=Path)
        s.add_argument("--output", required=True, type=Path)
        s.add_argument("--text-field", default="text")
        s.add_argument("--json", action="store_true", help="print the summary as JSON")
        s.add_argument("--output-format", choices=["jsonl", "parquet"], default=None)
        s.add_argument(
            "--ray-address",
            default=None,
            metavar="local|auto|HOST:PORT",
            help="run the tasks on Ray Data (default: in this process)",
        )
        s.add_argument("--block-docs", type=int, default=StreamConfig().block_docs)
        s.add_argument("--work-dir", type=Path, default=None)
        s.add_argument(
            "--keep-work", action="store_true", help="keep the work folder after success"
        )
    return p


class _ProgressPrinter:
    def __init__(self, quiet: bool):
        self.quiet, self.last, self.stage = quiet, 0.0, ""

    def __call__(self, p: Progress) -> None:
        now = time.time()
        final = p.tasks_done == p.tasks_total
        if self.quiet or (
            p.stage == self.stage and now - self.last < PROGRESS_INTERVAL_S and not final
        ):
            return
        self.last, self.stage = now, p.stage
        eta = f", eta {p.eta_s:.0f} s" if p.eta_s is not None else ""
        print(
            f"[{p.stage_index + 1}/{p.stages} {p.stage}] {p.tasks_done}/{p.tasks_total} "
            f"tasks, {p.docs_done}/{p.docs_total} docs, {p.bytes_done}/{p.bytes_total} "
            f"bytes, {p.elapsed_s:.0f} s{eta}",
            file=sys.stderr,
            flush=True,
        )


def _run(
    args: argparse.Namespace,
    dedup_cfg: DedupConfig | None,
    decon: tuple[DecontaminationConfig, list[EvalItem]] | None,
) -> tuple[StreamResult, dict[str, object]]:
    suffix_fmt = SINGLE_FILE_SUFFIXES.get(args.output.suffix)
    fmt = args.output_format or suffix_fmt or "jsonl"
    if suffix_fmt and suffix_fmt != fmt:
        raise ItoError(
            ErrorCode.bad_request, f"--output {args.output.name} is not a {fmt} file name"
        )
    cfg = StreamConfig(
        block_docs=args.block_docs, output_format="parquet" if fmt == "parquet" else "jsonl"
    )
    files = [(p, rel, f, 0, "custom") for p, rel, f in input_files(args.input)]
    shards_dir = args.output.with_name(args.output.name + ".shards") if suffix_fmt else args.output
    work = args.work_dir or args.output.with_name(args.output.name + ".work")
    with executor_for(args.ray_address, cfg) as executor:
        res = run_stream(
            files,
            shards_dir,
            text_field=args.text_field,
            dedup_cfg=dedup_cfg,
            decon=decon,
            cfg=cfg,
            work_dir=work,
            executor=executor,
            progress=_ProgressPrinter(quiet=False),
            keep_work=args.keep_work,
            flag_field=getattr(args, "flag_field", "contaminated"),
        )
    rows = _output_rows(shards_dir, res, args.output)
    if suffix_fmt:
        digest, size = concat_shards(shards_dir, [s["path"] for s in res.shards], args.output, fmt)
        shutil.rmtree(shards_dir, ignore_errors=True)
        out = {"path": str(args.output.resolve()), "sha256": digest, "bytes": size}
    else:
        out = {
            "path": str(args.output.resolve()),
            "format": fmt,
            "manifest": str(args.output.resolve() / "manifest.json"),
            "shards": res.shards,
            "bytes": sum(s["bytes"] for s in res.shards),
        }
    io = {
        **rows,
        "input": {
            "path": str(args.input.resolve()),
            "sha256": res.blocks_index.input_sha256(args.input.is_dir()),
            "files": [
                {"relpath": s.relpath, "sha256": s.sha256, "bytes": s.bytes}
                for s in res.blocks_index.sources
            ],
        },
        "output": out,
        "execution": {
            "executor": res.executor,
            "attempt": res.attempt,
            "blocks": len(res.blocks_index.blocks),
            "resumed_tasks": res.resumed_tasks,
            "stage_seconds": res.stage_seconds,
        },
    }
    return res, io


def _output_rows(folder: Path, res: StreamResult, output: Path) -> dict[str, Any]:
    """Output row n -> its input document id "0:<file>:<n>" (the shards' id files)."""
    names = [sh["ids"] for sh in res.shards]
    if res.counts["docs_out"] <= OUTPUT_ROWS_INLINE_MAX:
        ids: list[str] = []
        for name in names:
            ids += (folder / name).read_text("utf-8").splitlines()
        return {"output_rows": ids}
    dest = output.with_name(output.name + ".rows.txt")
    concat_shards(folder, names, dest, "jsonl")  # plain line files: a byte concatenation
    return {"output_rows_path": str(dest.resolve())}


def _summary(res: StreamResult, args: argparse.Namespace, prov: Path) -> dict[str, Any]:
    c = res.counts
    return {
        "command": args.command,
        "docs_in": c["docs_in"],
        "docs_out": c["docs_out"],
        "bytes_in": c["bytes_in"],
        "bytes_out": c["bytes_out"],
        "output": str(args.output),
        "provenance_path": str(prov),
        "executor": res.executor,
        "blocks": len(res.blocks_index.blocks),
        "resumed_tasks": res.resumed_tasks,
    }


def run_dedup(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DedupConfig(
        threshold=args.threshold, num_perm=args.num_perm, shingle_size=args.shingle_size
    )
    res, io = _run(args, cfg, None)
    prov = args.output.with_name(args.output.name + ".provenance.json")
    sec = dedup_section(res)
    write_json(
        prov,
        {
            "command": "dedup",
            **io,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "docs_in": res.counts["docs_in"],
            "docs_out": res.counts["docs_out"],
            "dedup": sec,
        },
    )
    return {
        **_summary(res, args, prov),
        "exact_duplicates": sec["exact_duplicates"],
        "near_duplicates": sec["near_duplicates"],
        "clusters": sec["clusters"],
        "bands": sec["parameters"]["bands"],
        "rows": sec["parameters"]["rows"],
    }


def run_decontaminate(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DecontaminationConfig(
        mode=args.mode,
        ngram=args.ngram,
        action=args.action,
        overlap_ngram=args.overlap_ngram,
        overlap_threshold=args.overlap_threshold,
    )
    items, infos = load_eval_items(args.suite, [str(p) for p in args.eval], args.eval_field)
    if not items:
        raise ItoError(ErrorCode.bad_request, "no eval items: give --eval PATH or --suite NAME")
    index = EvalIndex(items, cfg)
    res, io = _run(args, None, (cfg, items))
    prov = args.output.with_name(args.output.name + ".provenance.json")
    sec = decontam_section(res, index)
    write_json(
        prov,
        {
            "command": "decontaminate",
            **io,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "docs_in": res.counts["docs_in"],
            "docs_out": res.counts["docs_out"],
            "decontamination": {**sec, "eval_files": [vars(i) for i in infos]},
        },
    )
    return {
        **_summary(res, args, prov),
        "contaminated": res.counts["contaminated"],
        "action": cfg.action,
        "eval_items": len(items),
        "eval_items_matched": sec["eval_items_matched"],
        "method": cfg.mode,
        "ngram": index.n,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.time()
    try:
        if not args.input.exists():
            raise ItoError(ErrorCode.data_not_found, f"no such file or folder: {args.input}")
        summary = run_dedup(args) if args.command == "dedup" else run_decontaminate(args)
    except ValidationError as ve:  # a setting out of range (e.g. --block-docs 0)
        msg = "; ".join(f"{'.'.join(str(x) for x in d['loc'])}: {d['msg']}" for d in ve.errors())
        err = {"ok": False, "error": {"code": str(ErrorCode.bad_request), "message": msg}}
        print(
            json.dumps(err) if args.json else f"error [bad_request]: {msg}",
            file=sys.stdout if args.json else sys.stderr,
        )
        return 2
    except ItoError as e:
        err = {"ok": False, "error": {"code": str(e.code), "message": e.message}}
        print(
            json.dumps(err) if args.json else f"error [{e.code}]: {e.message}",
            file=sys.stdout if args.json else sys.stderr,
        )
        return 2
    summary = {"ok": True, **summary, "seconds": round(time.time() - t0, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}")
    return 0
