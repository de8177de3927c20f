"""DataPrepStage: manifest -> digests -> dedup -> decontamination -> outputs -> probe.

Everything is written under ``<workdir>/data_prep/``:
``data_manifest.json`` (refs, files, digests, documents, bytes), ``clean/<role>/
ref<k>.jsonl`` (the cleaned training records, every input field as given; flagged
documents carry ``"contaminated": true``) and ``provenance.json`` (what was removed
and why, by "<ref>:<file>:<line>" id, the eval files matched against, input and output
digests, the probe's numbers). Dedup, decontamination and the outputs run on the
streaming engine (``stages.data_prep.stream``), block by block, in this process or on
Ray Data; ``work/`` holds its resumable intermediate files while it runs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from stages.base import GateOutcome, StageContext
from stages.data_prep.config import DataPrepConfig
from stages.data_prep.decontam import EvalIndex
from stages.data_prep.evals import load_eval_items
from stages.data_prep.records import write_json
from stages.data_prep.refs import ResolvedRef, check_inside, resolve_ref
from stages.data_prep.stream.config import StreamConfig
from stages.data_prep.stream.output import concat_shards, executor_for
from stages.data_prep.stream.provenance import decontam_section, dedup_section
from stages.data_prep.stream.run import Progress, run_stream
from stages.errors import ErrorCode, ItoError
from stages.events import ProgressEvent

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

    def _ray_address(self, total_bytes: int) -> str | None:
        """ "ray" (the Ray this process is attached to) or None (this process)."""
        mode = self.config.stream.executor
        if mode == "local":
            return None
        try:
            import ray

            up = ray.is_initialized()
        except ImportError:  # pragma: no cover - ray is a dependency
            up = False
        if mode == "ray":
            if not up:  # never start a cluster from inside a stage
                raise ItoError(ErrorCode.ray_unavailable, "stream.executor=ray needs Ray up")
            return "auto"
        return "auto" if up and total_bytes >= self.config.stream.ray_min_bytes else None

    def _check(self, ctx: StageContext) -> None:
        if ctx.cancelled:
            raise _Cancelled

    def _fail(
        self,
        reason: str,
        code: ErrorCode | str,
        artifacts: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> GateOutcome:
        return GateOutcome(
            stage=self.name,
            status="failed",
            reason=reason,
            error_code=str(code),
            artifacts=artifacts or {},
            metrics=metrics or {},
        )

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

        # 1. Data manifest: resolve refs and check their digests before reading any. A
        # ref under the data roots is copied into the run's scratch space from the
        # descriptors that were hashed; everything below reads those copies.
        resolved: list[ResolvedRef] = []
        for i, ref in enumerate(cfg.refs):
            self._check(ctx)
            resolved.append(
                resolve_ref(
                    ref,
                    cache,
                    self.data_roots,
                    f"data.refs[{i}]",
                    copy_to=out / "inputs" / f"ref{i:02d}",
                )
            )
        manifest_refs: list[dict[str, Any]] = [
            {
                "index": k,
                "uri": r.ref.uri,
                "role": r.ref.role,
                "path": str(r.path),
                "expected_sha256": r.ref.sha256,
                "sha256": r.sha256,
                "digest_ok": r.digest_ok,
                "files": [
                    {
                        "path": str(f.path),
                        "relpath": f.relpath,
                        "format": f.format,
                        "sha256": f.sha256,
                        "bytes": f.bytes,
                        **({"origin": f.origin} if f.origin else {}),
                    }
                    for f in r.files
                ],
                "bytes": sum(f.bytes for f in r.files),
                "provenance": r.ref.provenance.model_dump(),
            }
            for k, r in enumerate(resolved)
        ]
        manifest_path = out / "data_manifest.json"
        bad = [m for m in manifest_refs if not m["digest_ok"]]
        if bad:
            write_json(manifest_path, {"run_id": ctx.run_id, "refs": manifest_refs})
            shutil.rmtree(out / "inputs", ignore_errors=True)  # nothing of it is read
            reason = "; ".join(
                f"{m['uri']}: expected {m['expected_sha256'][:12]}…, got {m['sha256'][:12]}…"
                for m in bad
            )
            self._log(ctx, f"data digest mismatch: {reason}", "error")
            return self._fail(
                f"data digest mismatch: {reason}",
                ErrorCode.data_digest_mismatch,
                artifacts={
                    "data_manifest_path": str(manifest_path),
                    "mismatched": [m["uri"] for m in bad],
                },
            )
        items, infos = load_eval_items(
            cfg.eval_suites, cfg.eval_files, cfg.eval_field, roots=self.data_roots
        )
        self._check(ctx)

        # 2-4. Dedup, decontamination and cleaned outputs: the streaming engine, block
        # by block, here or on Ray Data (the same code as ``python -m stages.data_prep``).
        files: list[tuple[Path, str, str, int, str]] = [
            (f.path, f.relpath, f.format, k, str(r.ref.role))
            for k, r in enumerate(resolved)
            for f in r.files
        ]
        decon = (cfg.decontamination, items) if cfg.decontamination.enabled and items else None
        index = EvalIndex(items, cfg.decontamination) if decon else None
        total_bytes = sum(m["bytes"] for m in manifest_refs)
        with executor_for(self._ray_address(total_bytes), cfg.stream) as executor:
            self._log(
                ctx,
                f"data manifest: {len(resolved)} refs, {len(files)} files, "
                f"{total_bytes} bytes, digests ok; streaming on {executor.name}",
            )
            res = run_stream(
                files,
                out / "clean.shards",
                dedup_cfg=cfg.dedup if cfg.dedup.enabled else None,
                decon=decon,
                cfg=cfg.stream,
                work_dir=out / "work",
                executor=executor,
                fields={k: r.ref.text_field for k, r in enumerate(resolved)},
                progress=_ProgressReporter(ctx, self.name, cfg.stream),
                cancelled=lambda: ctx.cancelled,
            )
        docs_of: dict[str, int] = {}
        for blk in res.blocks_index.blocks:
            src = res.blocks_index.sources[blk.source]
            docs_of[src.path] = docs_of.get(src.path, 0) + blk.docs
        for m in manifest_refs:
            for f in m["files"]:
                f["docs"] = docs_of.get(f["path"], 0)
            m["docs"] = sum(f["docs"] for f in m["files"])
        write_json(manifest_path, {"run_id": ctx.run_id, "refs": manifest_refs})
        c = res.counts
        docs_in, bytes_in, docs_out, bytes_out = (
            c["docs_in"],
            c["bytes_in"],
            c["docs_out"],
            c["bytes_out"],
        )
        dedup_rec: dict[str, Any] = {"enabled": False}
        if cfg.dedup.enabled:
            dedup_rec = {"enabled": True, **dedup_section(res)}
            self._log(
                ctx,
                f"dedup: {c['exact_duplicates']} exact and {c['near_duplicates']} "
                f"near duplicates removed ({res.executor}, {len(res.blocks_index.blocks)} "
                f"blocks, b={dedup_rec['parameters']['bands']} "
                f"r={dedup_rec['parameters']['rows']})",
            )
        decon_rec: dict[str, Any] = {"enabled": False}
        if index is not None:
            decon_rec = {
                "enabled": True,
                **decontam_section(res, index),
                "eval_files": [vars(i) for i in infos],
            }
            self._log(
                ctx,
                f"decontamination: {c['contaminated']} documents matched "
                f"{decon_rec['eval_items_matched']} eval items "
                f"({cfg.decontamination.mode}, n={index.n}); "
                f"{cfg.decontamination.action}d",
            )
        contaminated = c["contaminated"]
        self._check(ctx)

        # One cleaned file per ref (its shards joined in order), grouped by role.
        train_files: dict[str, list[str]] = {"baseline": [], "custom": []}
        outputs = []
        fields: dict[str, str] = {}  # each cleaned file's text field, for the probe
        fmt = cfg.stream.output_format
        for k, r in enumerate(resolved):
            shards = [sh for sh in res.shards if res.blocks_index.sources[sh["source"]].ref == k]
            path = out / "clean" / r.ref.role / f"ref{k:02d}.{fmt}"
            digest, size = concat_shards(res.output_dir, [sh["path"] for sh in shards], path, fmt)
            count = sum(sh["docs"] for sh in shards)
            fields[str(path)] = r.ref.text_field
            outputs.append(
                {
                    "ref": k,
                    "role": r.ref.role,
                    "path": str(path),
                    "sha256": digest,
                    "bytes": size,
                    "docs": count,
                }
            )
            if count:
                train_files[r.ref.role].append(str(path))
        shutil.rmtree(res.output_dir, ignore_errors=True)
        shutil.rmtree(out / "inputs", ignore_errors=True)  # the private input copies

        # 5. Ladder probe on the cleaned data.
        ladder = self._ladder(ctx, train_files, [it.text for it in items], fields)

        provenance_path = out / "provenance.json"
        write_json(
            provenance_path,
            {
                "version": PROVENANCE_VERSION,
                "run_id": ctx.run_id,
                "booking_id": ctx.booking_id,
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "inputs": manifest_refs,
                "dedup": dedup_rec,
                "decontamination": decon_rec,
                "outputs": outputs,
                "ladder": ladder,
                "counts": {
                    "docs_in": docs_in,
                    "docs_out": docs_out,
                    "bytes_in": bytes_in,
                    "bytes_out": bytes_out,
                    "contaminated": contaminated,
                },
            },
        )
        metrics: dict[str, float] = {
            "docs_in": docs_in,
            "docs_out": docs_out,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "exact_duplicates": dedup_rec.get("exact_duplicates", 0),
            "near_duplicates": dedup_rec.get("near_duplicates", 0),
            "contaminated": contaminated,
            "seconds": time.time() - t0,
        }
        for key in ("delta_bpb", "margin_bpb", "baseline_bpb_mean", "custom_bpb_mean"):
            if key in ladder.get("stats", {}):
                metrics[f"ladder_{key}"] = ladder["stats"][key]
        artifacts = {
            "train_files": train_files,
            "provenance_path": str(provenance_path),
            "data_manifest_path": str(manifest_path),
            "ladder": ladder,
        }
        decision = ladder["decision"]
        summary = (
            f"{docs_in} → {docs_out} documents ({metrics['exact_duplicates']:.0f} exact, "
            f"{metrics['near_duplicates']:.0f} near duplicates, {contaminated} "
            f"contaminated); ladder probe: {decision}"
        )
        self._log(ctx, summary)
        if decision == "reject" and cfg.ladder_probe.reject_fails_gate:
            return GateOutcome(
                stage=self.name,
                status="failed",
                error_code=ErrorCode.gate_failed,
                reason=f"ladder probe rejected the custom data: {summary}",
                metrics=metrics,
                artifacts=artifacts,
            )
        status = "no_decision" if decision == "no_decision" else "passed"
        return GateOutcome(
            stage=self.name, status=status, reason=summary, metrics=metrics, artifacts=artifacts
        )

    def _ladder(
        self,
        ctx: StageContext,
        train_files: dict[str, list[str]],
        eval_texts: list[str],
        fields: dict[str, str],
    ) -> dict[str, Any]:
        cfg = self.config.ladder_probe
        cap = self.config.probe_max_bytes
        base = _read_texts(train_files["baseline"], fields, cap) if cfg.enabled else []
        custom = _read_texts(train_files["custom"], fields, cap) if cfg.enabled else []
        why = (
            "disabled"
            if not cfg.enabled
            else "no baseline data"
            if not base
            else "no custom data"
            if not custom
            else "no eval text"
            if not eval_texts
            else ""
        )
        if why:
            self._log(ctx, f"ladder probe skipped: {why}")
            return {"decision": "skipped", "reason": why}
        from stages.data_prep.ladder import ladder_probe
        from stages.data_prep.ladder_ranks import NoRanks, rank_runner

        # A run's proxies train on its trainer ranks, warming up meanwhile, never in the
        # driver; a stage run alone (no fleet) trains them in this process.
        run_arms = None if ctx.fleet is None else rank_runner(ctx.fleet, lambda: ctx.cancelled)
        try:
            result = ladder_probe(
                base,
                custom,
                eval_texts,
                cfg,
                log=lambda m: self._log(ctx, m),
                cancelled=lambda: ctx.cancelled,
                run_arms=run_arms,
            )
        # Too little text for one window: nothing to measure. No ranks: the train stage
        # could not place its fleet, and says why in its turn.
        except (ValueError, NoRanks) as e:
            self._log(ctx, f"ladder probe skipped: {e}", "warning")
            return {"decision": "skipped", "reason": str(e)}
        self._log(
            ctx,
            f"ladder probe: {result.decision} (Δ={result.stats['delta_bpb']:+.4f} "
            f"bits/byte, margin {result.stats['margin_bpb']:.4f})",
        )
        return {**result.as_dict(), "reason": ""}


def _read_texts(paths: list[str], fields: dict[str, str], max_bytes: int) -> list[str]:
    """The texts of cleaned files in order, up to ``max_bytes`` of UTF-8 in all."""
    from stages.trainer.rank.data import iter_documents

    out: list[str] = []
    size = 0
    for p in paths:
        for text in iter_documents(Path(p), fields[p]):
            size += len(text.encode("utf-8"))
            if size > max_bytes:
                return out
            out.append(text)
    return out


class _ProgressReporter:
    """Streaming progress as ``ProgressEvent``s (and a log line per step and every
    ``progress_interval_s``), which ``ito status``, logs and /metrics show."""

    def __init__(self, ctx: StageContext, stage: str, cfg: StreamConfig):
        self.ctx, self.stage, self.cfg = ctx, stage, cfg
        self.step, self.last = "", 0.0

    def __call__(self, p: Progress) -> None:
        now = time.time()
        final = p.tasks_done == p.tasks_total
        if p.stage == self.step and now - self.last < self.cfg.progress_interval_s and not final:
            return
        if p.stage != self.step or final:
            eta = f", eta {p.eta_s:.0f} s" if p.eta_s else ""
            self.ctx.log(
                f"data prep {p.stage} ({p.stage_index + 1}/{p.stages}): "
                f"{p.tasks_done}/{p.tasks_total} tasks, {p.docs_done}/{p.docs_total} "
                f"documents{eta}",
                stage=self.stage,
            )
        self.step, self.last = p.stage, now
        self.ctx.emit(
            ProgressEvent(
                stage=self.stage,
                step=p.stage,
                step_index=p.stage_index,
                steps=p.stages,
                tasks_done=p.tasks_done,
                tasks_total=p.tasks_total,
                docs_done=p.docs_done,
                docs_total=p.docs_total,
                bytes_done=p.bytes_done,
                bytes_total=p.bytes_total,
                elapsed_s=round(p.elapsed_s, 3),
                eta_s=None if p.eta_s is None else round(p.eta_s, 3),
            )
        )
