"""Command line for preparing data before booking.

    python -m stages.data_prep dedup --input PATH --output PATH [--json]
    python -m stages.data_prep decontaminate --input PATH --eval PATH... --output PATH [--json]

``--input`` is a file or a folder of jsonl/parquet/text (``--text-field``, default
"text"); ``--output`` a jsonl file of the caller's records, every field as it was (a
text line becomes ``{"<text-field>": line}``), in input order. With ``--action flag``
a flagged record gets one more field, ``--flag-field`` (default "contaminated"). The
provenance record is written beside it as ``<output>.provenance.json``; its
``output_rows`` maps output line n to the input document id "0:<file>:<n>". Eval
files are jsonl with a text field named by ``--eval-field`` (default "question") or
plain text, one item a line.
Exit status 0 on success, 2 on an error (printed with its stable code).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stages.data_prep.config import DecontaminationConfig, DedupConfig
from stages.data_prep.decontam import EvalIndex, decontaminate
from stages.data_prep.dedup import dedup
from stages.data_prep.evals import load_eval_items
from stages.data_prep.records import dedup_record, read_input, text_bytes, write_json, write_jsonl
from stages.data_prep.refs import path_sha256
from stages.errors import ErrorCode, ItoError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stages.data_prep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dedup", help="exact + MinHash-LSH near-duplicate removal")
    d.add_argument("--threshold", type=float, default=DedupConfig().threshold)
    d.add_argument("--num-perm", type=int, default=DedupConfig().num_perm)
    d.add_argument("--shingle-size", type=int, default=DedupConfig().shingle_size)
    c = sub.add_parser("decontaminate", help="remove or flag documents containing eval items")
    c.add_argument("--eval", nargs="+", default=[], metavar="PATH", help="eval files")
    c.add_argument("--suite", action="append", default=[],
                   help="also a registered eval suite (configs/evals/<suite>.json)")
    c.add_argument("--eval-field", default="question")
    c.add_argument("--mode", choices=["ngram", "overlap"], default="ngram")
    c.add_argument("--ngram", type=int, default=DecontaminationConfig().ngram)
    c.add_argument("--overlap-ngram", type=int, default=DecontaminationConfig().overlap_ngram)
    c.add_argument("--overlap-threshold", type=float,
                   default=DecontaminationConfig().overlap_threshold)
    c.add_argument("--action", choices=["remove", "flag"], default="remove")
    c.add_argument("--flag-field", default="contaminated",
                   help="with --action flag: the field set to true on flagged records")
    for s in (d, c):
        s.add_argument("--input", required=True, type=Path)
        s.add_argument("--output", required=True, type=Path)
        s.add_argument("--text-field", default="text")
        s.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _io_record(args: argparse.Namespace, digest_out: str, size: int) -> dict[str, Any]:
    return {"input": {"path": str(args.input.resolve()), "sha256": path_sha256(args.input)},
            "output": {"path": str(args.output.resolve()), "sha256": digest_out, "bytes": size}}


def run_dedup(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DedupConfig(threshold=args.threshold, num_perm=args.num_perm,
                      shingle_size=args.shingle_size)
    corpus = read_input(args.input, args.text_field)
    res = dedup(corpus.texts, cfg)
    kept = [i for i in range(len(corpus)) if res.keep[i]]
    digest, size, count = write_jsonl(args.output, (corpus.records[i] for i in kept))
    prov = args.output.with_name(args.output.name + ".provenance.json")
    write_json(prov, {"command": "dedup", **_io_record(args, digest, size),
                      "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                      "docs_in": len(corpus), "docs_out": count,
                      "output_rows": [corpus.ids[i] for i in kept],
                      "dedup": dedup_record(res, cfg, corpus.ids)})
    return {"command": "dedup", "docs_in": len(corpus), "docs_out": count,
            "exact_duplicates": res.exact_duplicates, "near_duplicates": res.near_duplicates,
            "clusters": len(res.clusters), "bands": res.bands, "rows": res.rows,
            "bytes_in": text_bytes(corpus.texts),
            "bytes_out": text_bytes(corpus.texts[i] for i in kept),
            "output": str(args.output), "provenance_path": str(prov)}


def run_decontaminate(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DecontaminationConfig(mode=args.mode, ngram=args.ngram, action=args.action,
                                overlap_ngram=args.overlap_ngram,
                                overlap_threshold=args.overlap_threshold)
    items, infos = load_eval_items(args.suite, [str(p) for p in args.eval], args.eval_field)
    if not items:
        raise ItoError(ErrorCode.bad_request, "no eval items: give --eval PATH or --suite NAME")
    corpus = read_input(args.input, args.text_field)
    index = EvalIndex(items, cfg)
    res = decontaminate(corpus.texts, index)
    if cfg.action == "flag" and any(args.flag_field in r for r in corpus.records):
        raise ItoError(ErrorCode.bad_request, f"--flag-field {args.flag_field!r} is already "
                       "a field of the input records: name another")
    kept = [i for i, bad in enumerate(res.contaminated)
            if not (bad and cfg.action == "remove")]
    rows = ({**corpus.records[i], args.flag_field: True} if res.contaminated[i]
            else corpus.records[i] for i in kept)
    digest, size, count = write_jsonl(args.output, rows)
    prov = args.output.with_name(args.output.name + ".provenance.json")
    write_json(prov, {"command": "decontaminate", **_io_record(args, digest, size),
                      "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                      "docs_in": len(corpus), "docs_out": count,
                      "output_rows": [corpus.ids[i] for i in kept],
                      "decontamination": {**res.record(corpus.ids),
                                          "eval_files": [vars(i) for i in infos]}})
    return {"command": "decontaminate", "docs_in": len(corpus), "docs_out": count,
            "contaminated": res.num_contaminated, "action": cfg.action,
            "eval_items": len(items), "eval_items_matched": len({m.item for m in res.matches}),
            "method": cfg.mode, "ngram": index.n, "output": str(args.output),
            "provenance_path": str(prov)}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.time()
    try:
        if not args.input.exists():
            raise ItoError(ErrorCode.data_not_found, f"no such file or folder: {args.input}")
        summary = run_dedup(args) if args.command == "dedup" else run_decontaminate(args)
    except ItoError as e:
        err = {"ok": False, "error": {"code": str(e.code), "message": e.message}}
        print(json.dumps(err) if args.json else f"error [{e.code}]: {e.message}",
              file=sys.stdout if args.json else sys.stderr)
        return 2
    summary = {"ok": True, **summary, "seconds": round(time.time() - t0, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}")
    return 0
