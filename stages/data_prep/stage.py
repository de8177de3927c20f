"""DataPrepStage: manifest -> digests -> dedup -> decontamination -> outputs -> probe.

Everything is written under ``<workdir>/data_prep/``:
``data_manifest.json`` (refs, files, digests, documents, bytes), ``clean/<role>/
ref<k>.jsonl`` (the cleaned training text, ``{"text", "id"}`` a line; flagged documents
carry ``"contaminated": true``) and ``provenance.json`` (what was removed and why,
the eval files matched against, input and output digests, the probe's numbers).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stages.base import GateOutcome, StageContext
from stages.data_prep.config import DataPrepConfig
from stages.data_prep.decontam import EvalIndex, decontaminate
from stages.data_prep.dedup import dedup
from stages.data_prep.evals import load_eval_items
from stages.data_prep.ladder import ladder_probe
from stages.data_prep.records import (
    Corpus,
    dedup_record,
    text_bytes,
    write_json,
    write_jsonl,
)
from stages.data_prep.refs import ResolvedRef, check_inside, resolve_ref
from stages.errors import ErrorCode, ItoError

PROVENANCE_VERSION = 1


class _Cancelled(Exception):
    pass


class DataPrepStage:
    name: ClassVar[str] = "data_prep"
    config_model: ClassVar[type[DataPrepConfig]] = DataPrepConfig

    def __init__(self, config: DataPrepConfig, data_roots: Sequence[str] | None = None):
        self.config = config
        # The account's data roots (operator's, never the tenant's): every file:// ref,
        # eval file and cache folder must lie inside one. None only outside a run
        # (the stage CLI and unit tests).
        self.data_roots = tuple(data_roots) if data_roots is not None else None

    def _log(self, ctx: StageContext, message: str, level: str = "info") -> None:
        ctx.log(message, level=level, stage=self.name)  # type: ignore[arg-type]

    def _check(self, ctx: StageContext) -> None:
        if ctx.cancelled:
            raise _Cancelled

    def _fail(self, reason: str, code: ErrorCode | str,
              artifacts: dict[str, Any] | None = None,
              metrics: dict[str, float] | None = None) -> GateOutcome:
        return GateOutcome(stage=self.name, status="failed", reason=reason,
                           error_code=str(code), artifacts=artifacts or {},
                           metrics=metrics or {})

    def run(self, ctx: StageContext) -> GateOutcome:
        try:
            return self._run(ctx)
        except (_Cancelled, InterruptedError):
            self._log(ctx, "data prep cancelled", "warning")
            return self._fail("cancelled", ErrorCode.stage_failed)
        except ItoError as e:
            self._log(ctx, e.message, "error")
            return self._fail(e.message, e.code, artifacts={"details": e.details})

    def _run(self, ctx: StageContext) -> GateOutcome:
        cfg = self.config
        t0 = time.time()
        out = Path(ctx.workdir) / "data_prep"
        cache = Path(cfg.cache_dir) if cfg.cache_dir else None
        if cache is not None and self.data_roots is not None:
            fd, _ = check_inside(str(cache), self.data_roots, "data.cache_dir", want="dir")
            if fd is not None:
                os.close(fd)

        # 1. Data manifest: resolve refs, digests, documents, bytes.
        resolved: list[ResolvedRef] = []
        for i, ref in enumerate(cfg.refs):
            self._check(ctx)
            resolved.append(resolve_ref(ref, cache, self.data_roots, f"data.refs[{i}]"))
        corpus = Corpus()
        manifest_refs = []
        for k, r in enumerate(resolved):
            self._check(ctx)
            files = corpus.add_ref(k, r) if r.digest_ok else []
            manifest_refs.append({
                "index": k, "uri": r.ref.uri, "role": r.ref.role, "path": str(r.path),
                "expected_sha256": r.ref.sha256, "sha256": r.sha256, "digest_ok": r.digest_ok,
                "files": files or [{"path": str(f.path), "relpath": f.relpath,
                                    "sha256": f.sha256, "bytes": f.bytes}
                                   for f in r.files],
                "docs": sum(f.get("docs", 0) for f in files),
                "bytes": sum(f.bytes for f in r.files),
                "provenance": r.ref.provenance.model_dump(),
            })
        manifest_path = out / "data_manifest.json"
        write_json(manifest_path, {"run_id": ctx.run_id, "refs": manifest_refs})
        bad = [m for m in manifest_refs if not m["digest_ok"]]
        if bad:
            reason = "; ".join(f"{m['uri']}: expected {m['expected_sha256'][:12]}…, "
                               f"got {m['sha256'][:12]}…" for m in bad)
            self._log(ctx, f"data digest mismatch: {reason}", "error")
            return self._fail(f"data digest mismatch: {reason}", ErrorCode.data_digest_mismatch,
                              artifacts={"data_manifest_path": str(manifest_path),
                                         "mismatched": [m["uri"] for m in bad]})
        if len(corpus) == 0:
            raise ItoError(ErrorCode.data_empty, "the data refs hold no documents")
        docs_in, bytes_in = len(corpus), text_bytes(corpus.texts)
        self._log(ctx, f"data manifest: {len(resolved)} refs, {docs_in} documents, "
                       f"{bytes_in} bytes, digests ok")

        # 2. Exact + near-duplicate removal over all refs together.
        keep = np.ones(docs_in, dtype=bool)
        dedup_rec: dict[str, Any] = {"enabled": False}
        if cfg.dedup.enabled:
            res = dedup(corpus.texts, cfg.dedup, cancelled=lambda: ctx.cancelled)
            keep = res.keep.copy()
            dedup_rec = {"enabled": True, **dedup_record(res, cfg.dedup, corpus.ids)}
            self._log(ctx, f"dedup: {res.exact_duplicates} exact and {res.near_duplicates} "
                           f"near duplicates removed ({res.backend}, {res.shards} shards, "
                           f"b={res.bands} r={res.rows})")
        self._check(ctx)

        # 3. Decontamination of the survivors against the eval suites and files.
        items, infos = load_eval_items(cfg.eval_suites, cfg.eval_files, cfg.eval_field,
                                       roots=self.data_roots)
        flagged = np.zeros(docs_in, dtype=bool)
        decon_rec: dict[str, Any] = {"enabled": False}
        survivors = np.flatnonzero(keep)
        if cfg.decontamination.enabled and items:
            index = EvalIndex(items, cfg.decontamination)
            dres = decontaminate([corpus.texts[i] for i in survivors], index,
                                 cancelled=lambda: ctx.cancelled)
            hit = survivors[dres.contaminated]
            if cfg.decontamination.action == "remove":
                keep[hit] = False
            else:
                flagged[hit] = True
            decon_rec = {"enabled": True,
                         **dres.record([corpus.ids[i] for i in survivors]),
                         "eval_files": [vars(i) for i in infos]}
            self._log(ctx, f"decontamination: {len(hit)} documents matched "
                           f"{decon_rec['eval_items_matched']} eval items "
                           f"({cfg.decontamination.mode}, n={index.n}); "
                           f"{cfg.decontamination.action}d")
        contaminated = len(survivors) - int(keep[survivors].sum()) + int(flagged.sum())
        self._check(ctx)

        # 4. Cleaned outputs, one jsonl per ref, grouped by role.
        train_files: dict[str, list[str]] = {"baseline": [], "custom": []}
        outputs = []
        ref_of = np.asarray(corpus.refs, dtype=np.int64)
        for k, r in enumerate(resolved):
            idx = np.flatnonzero(keep & (ref_of == k)).tolist()
            path = out / "clean" / r.ref.role / f"ref{k:02d}.jsonl"
            rows = ({"text": corpus.texts[i], "id": corpus.ids[i],
                     **({"contaminated": True} if flagged[i] else {})} for i in idx)
            digest, size, count = write_jsonl(path, rows)
            outputs.append({"ref": k, "role": r.ref.role, "path": str(path), "sha256": digest,
                            "bytes": size, "docs": count})
            if count:
                train_files[r.ref.role].append(str(path))
        docs_out = int(keep.sum())
        bytes_out = text_bytes(corpus.texts[i] for i in np.flatnonzero(keep))

        # 5. Ladder probe on the cleaned data.
        ladder = self._ladder(ctx, corpus, keep, [it.text for it in items])

        provenance_path = out / "provenance.json"
        write_json(provenance_path, {
            "version": PROVENANCE_VERSION, "run_id": ctx.run_id,
            "booking_id": ctx.booking_id,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "inputs": manifest_refs, "dedup": dedup_rec, "decontamination": decon_rec,
            "outputs": outputs, "ladder": ladder,
            "counts": {"docs_in": docs_in, "docs_out": docs_out, "bytes_in": bytes_in,
                       "bytes_out": bytes_out, "contaminated": contaminated},
        })
        metrics: dict[str, float] = {
            "docs_in": docs_in, "docs_out": docs_out, "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "exact_duplicates": dedup_rec.get("exact_duplicates", 0),
            "near_duplicates": dedup_rec.get("near_duplicates", 0),
            "contaminated": contaminated, "seconds": time.time() - t0,
        }
        for key in ("delta_bpb", "margin_bpb", "baseline_bpb_mean", "custom_bpb_mean"):
            if key in ladder.get("stats", {}):
                metrics[f"ladder_{key}"] = ladder["stats"][key]
        artifacts = {"train_files": train_files, "provenance_path": str(provenance_path),
                     "data_manifest_path": str(manifest_path), "ladder": ladder}
        decision = ladder["decision"]
        summary = (f"{docs_in} → {docs_out} documents ({metrics['exact_duplicates']:.0f} exact, "
                   f"{metrics['near_duplicates']:.0f} near duplicates, {contaminated} "
                   f"contaminated); ladder probe: {decision}")
        self._log(ctx, summary)
        if decision == "reject" and cfg.ladder_probe.reject_fails_gate:
            return GateOutcome(stage=self.name, status="failed", error_code=ErrorCode.gate_failed,
                               reason=f"ladder probe rejected the custom data: {summary}",
                               metrics=metrics, artifacts=artifacts)
        status = "no_decision" if decision == "no_decision" else "passed"
        return GateOutcome(stage=self.name, status=status, reason=summary, metrics=metrics,
                           artifacts=artifacts)

    def _ladder(self, ctx: StageContext, corpus: Corpus, keep: np.ndarray,
                eval_texts: list[str]) -> dict[str, Any]:
        cfg = self.config.ladder_probe
        kept = np.flatnonzero(keep)
        base = [corpus.texts[i] for i in kept if corpus.roles[i] == "baseline"]
        custom = [corpus.texts[i] for i in kept if corpus.roles[i] == "custom"]
        why = ("disabled" if not cfg.enabled else
               "no baseline data" if not base else
               "no custom data" if not custom else
               "no eval text" if not eval_texts else "")
        if why:
            self._log(ctx, f"ladder probe skipped: {why}")
            return {"decision": "skipped", "reason": why}
        try:
            result = ladder_probe(base, custom, eval_texts, cfg, log=lambda m: self._log(ctx, m),
                                  cancelled=lambda: ctx.cancelled)
        except ValueError as e:  # too little text for one window: nothing to measure
            self._log(ctx, f"ladder probe skipped: {e}", "warning")
            return {"decision": "skipped", "reason": str(e)}
        self._log(ctx, f"ladder probe: {result.decision} (Δ={result.stats['delta_bpb']:+.4f} "
                       f"bits/byte, margin {result.stats['margin_bpb']:.4f})")
        return {**result.as_dict(), "reason": ""}
