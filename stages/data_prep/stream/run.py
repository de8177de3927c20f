"""The driver of streaming data prep: index the input, run the stages with resume, publish.

``run_stream`` is what the command line and the data-prep stage call. The driver
holds only the block index (one entry per block) and the tasks' small done records; every
document is read and written by tasks (``tasks.py``), in this process or on Ray Data
(``executor.py``). Memory: the driver's is proportional to the number of blocks; a
task's to one block (``block_docs``) or one bucket partition (``rows_per_partition``
band rows) or, for fetch/verify/components, to the candidate pairs it handles.

Resume: the attempt folder is ``<work>/<key>`` where ``key`` digests the inputs'
bytes, the block index and every parameter. A rerun with the same inputs and settings
finds it, skips every finished stage and task whose outputs still match their
recorded sha256, and re-runs the rest; anything else gets a new folder, so two
attempts never mix. The output folder is published whole at the end (renamed into
place, with ``manifest.json`` listing every shard and its sha256): a reader sees the
old output or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, get_args

from stages.data_prep.config import DecontaminationConfig, DedupConfig
from stages.data_prep.evals import EvalItem
from stages.data_prep.minhash import lsh_params
from stages.data_prep.stream.blocks import BlockIndex, index_blocks
from stages.data_prep.stream.config import StreamConfig
from stages.data_prep.stream.executor import Executor, LocalExecutor
from stages.data_prep.stream.store import ContaminatedDocument, TaskRecord, WorkDir, write_json
from stages.errors import ErrorCode, ItoError

# Bumped whenever a task's output format or meaning changes: old work folders are
# then never reused.
STREAM_FORMAT_VERSION = 2
DEDUP_STAGES = ("sketch", "exact", "candidates", "fetch", "verify", "components")
# The filter tasks' counts the run adds up (``StreamResult.counts``).
CountKey = Literal[
    "docs_in",
    "docs_out",
    "bytes_in",
    "bytes_out",
    "exact_duplicates",
    "near_duplicates",
    "contaminated",
]
COUNT_KEYS: tuple[CountKey, ...] = get_args(CountKey)


@dataclass
class Progress:
    """One progress report: where the run is and how far it has to go."""

    stage: str
    stage_index: int
    stages: int
    tasks_done: int
    tasks_total: int
    docs_done: int
    docs_total: int
    bytes_done: int
    bytes_total: int
    elapsed_s: float
    eta_s: float | None  # of this stage, from its rate in this attempt
    resumed_tasks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Shard(TypedDict):
    """One output shard (a filter task's), as ``manifest.json`` lists it: its file,
    digest, size and documents, the block and input source it came from, and its ids
    file (output row -> input document id)."""

    path: str
    sha256: str
    bytes: int
    docs: int
    block: int
    source: int
    ids: str


class DedupParams(TypedDict):
    """The dedup settings an attempt is keyed on (``params.json``'s ``dedup``, which
    the tasks read back): the config's, and the LSH bands x rows they give."""

    threshold: float
    num_perm: int
    shingle_size: int
    seed: int
    recall_target: float
    bands: int
    rows: int


class DedupSummary(DedupParams):
    """A run's dedup: its settings, its bucket partitions, and what the stages found
    (``examples``: [duplicate, survivor] document indices)."""

    partitions: int
    candidate_pairs: int
    verified_pairs: int
    clusters: int
    near_duplicates: int
    exact_duplicates: int
    examples: list[list[int]]


@dataclass
class StreamResult:
    output_dir: Path
    attempt: str
    executor: str
    blocks_index: BlockIndex
    shards: list[Shard]
    counts: dict[str, int]
    dedup: DedupSummary | None
    contaminated_documents: list[ContaminatedDocument]
    resumed_tasks: int
    stage_seconds: dict[str, float] = field(default_factory=dict)


def attempt_key(index: BlockIndex, params: dict[str, Any]) -> str:
    # "plan": a stored name (hashed into existing attempt keys), kept for compatibility.
    blob = json.dumps(
        {"version": STREAM_FORMAT_VERSION, "plan": index.to_json(), "params": params},
        sort_keys=True,
    ).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _partitions(docs: int, bands: int, cfg: StreamConfig) -> int:
    return max(cfg.min_partitions, math.ceil(docs * bands / cfg.rows_per_partition))


def run_stream(
    files: list[tuple[Path, str, str, int, str]],
    output_dir: Path,
    *,
    text_field: str = "text",
    dedup_cfg: DedupConfig | None = None,
    decon: tuple[DecontaminationConfig, list[EvalItem]] | None = None,
    cfg: StreamConfig | None = None,
    work_dir: Path | None = None,
    executor: Executor | None = None,
    progress: Callable[[Progress], None] = lambda _p: None,
    cancelled: Callable[[], bool] = lambda: False,
    keep_work: bool = False,
    fields: dict[int, str] | None = None,
    flag_field: str = "contaminated",
) -> StreamResult:
    """Dedup (when ``dedup_cfg``), then filter + decontaminate (when ``decon``) the
    documents of ``files`` ((path, relpath, format, ref, role) in input order) into
    sharded ``output_dir``. See the module docstring."""
    cfg = cfg or StreamConfig()
    executor = executor or LocalExecutor()
    output_dir = Path(output_dir)
    work_dir = Path(work_dir) if work_dir else output_dir.with_name(output_dir.name + ".work")
    t0 = time.time()
    index = index_blocks(files, text_field, cfg.block_docs, fields)
    if index.docs == 0:
        raise ItoError(ErrorCode.data_empty, "the input holds no documents")
    params: dict[str, Any] = {
        "output_format": cfg.output_format,
        "text_field": text_field,
        "flag_field": flag_field,
    }
    dedup_params: DedupParams | None = None
    if dedup_cfg is not None:
        bands, rows = lsh_params(dedup_cfg.threshold, dedup_cfg.num_perm, dedup_cfg.recall_target)
        params["dedup"] = dedup_params = {
            "threshold": dedup_cfg.threshold,
            "num_perm": dedup_cfg.num_perm,
            "shingle_size": dedup_cfg.shingle_size,
            "seed": dedup_cfg.seed,
            "recall_target": dedup_cfg.recall_target,
            "bands": bands,
            "rows": rows,
        }
        params["partitions"] = _partitions(index.docs, bands, cfg)
    evals_obj = None
    if decon is not None:
        dcfg, items = decon
        params["decontamination"] = dcfg.model_dump()
        evals_obj = {"config": dcfg.model_dump(), "items": [asdict(it) for it in items]}
        params["eval_items_sha256"] = hashlib.sha256(
            json.dumps(evals_obj, sort_keys=True).encode()
        ).hexdigest()
    key = attempt_key(index, params)
    wd = WorkDir(work_dir / key[:24])
    # "plan.json": a stored file name (read by tasks.py), kept for compatibility.
    if not (wd.path("plan.json").exists() and wd.path("params.json").exists()):
        write_json(wd.path("plan.json"), index.to_json())
        if evals_obj is not None:
            write_json(wd.path("evals.json"), evals_obj)
        write_json(wd.path("params.json"), params)  # last: marks the folder complete

    blocks = list(range(len(index.blocks)))
    parts = list(range(params.get("partitions", 0)))
    stages: list[tuple[str, list[int]]] = []
    if dedup_cfg is not None:
        stages += [
            ("sketch", blocks),
            ("exact", parts),
            ("candidates", parts),
            ("fetch", blocks),
            ("verify", blocks),
            ("components", [0]),
        ]
    stages.append(("filter", blocks))
    records: dict[str, dict[int, TaskRecord]] = {}
    resumed = 0
    seconds: dict[str, float] = {}
    for si, (stage, tasks) in enumerate(stages):
        if cancelled():
            raise InterruptedError("data prep cancelled")
        ts = time.time()

        def report(
            done: int,
            total: int,
            docs: int,
            nbytes: int,
            eta: float | None,
            r: int,
            s: str = stage,
            i: int = si,
        ) -> None:
            progress(
                Progress(
                    s,
                    i,
                    len(stages),
                    done,
                    total,
                    docs,
                    index.docs,
                    nbytes,
                    index.bytes,
                    time.time() - t0,
                    eta,
                    r,
                )
            )

        records[stage], n_resumed = _run_stage(
            wd, stage, tasks, executor, cfg, index, report, cancelled
        )
        resumed += n_resumed
        seconds[stage] = round(time.time() - ts, 3)

    filt = [records["filter"][b] for b in blocks]
    shards: list[Shard] = [
        {
            "path": r["stats"]["shard"],
            "sha256": r["stats"]["sha256"],
            "bytes": r["stats"]["shard_bytes"],
            "docs": r["stats"]["docs_out"],
            "block": b,
            "source": index.blocks[b].source,
            "ids": r["stats"]["ids"],
        }
        for b, r in zip(blocks, filt, strict=True)
    ]
    counts: dict[str, int] = {k: sum(int(r["stats"][k]) for r in filt) for k in COUNT_KEYS}
    dedup_summary: DedupSummary | None = None
    if dedup_params is not None:
        comp = records["components"][0]["stats"]
        dedup_summary = DedupSummary(
            **dedup_params,
            partitions=params["partitions"],
            candidate_pairs=sum(r["stats"]["pairs"] for r in records["fetch"].values()),
            verified_pairs=comp["verified_pairs"],
            clusters=comp["clusters"],
            near_duplicates=comp["near_duplicates"],
            exact_duplicates=counts["exact_duplicates"],
            examples=comp["examples"],
        )
    contaminated = [d for r in filt for d in r["stats"]["contaminated_documents"]]
    _publish(wd, output_dir, key, shards)
    if not keep_work:
        shutil.rmtree(wd.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            work_dir.rmdir()  # only if no other attempt is in it
    return StreamResult(
        output_dir,
        key,
        executor.name,
        index,
        shards,
        counts,
        dedup_summary,
        contaminated,
        resumed,
        seconds,
    )


def _run_stage(
    wd: WorkDir,
    stage: str,
    tasks: list[int],
    executor: Executor,
    cfg: StreamConfig,
    index: BlockIndex,
    report: Callable[[int, int, int, int, float | None, int], None],
    cancelled: Callable[[], bool],
) -> tuple[dict[int, TaskRecord], int]:
    summary = wd.stage_done(stage)
    if summary is not None:
        recs = {int(k): v for k, v in summary["tasks"].items()}
        report(len(tasks), len(tasks), index.docs, index.bytes, 0.0, len(tasks))
        return recs, len(tasks)
    done: dict[int, TaskRecord] = {}
    for t in tasks:
        rec = wd.finished(stage, str(t), verify=cfg.verify_digests)
        if rec is not None:
            done[t] = rec
    resumed = len(done)
    pending = [t for t in tasks if t not in done]
    per_block = stage in ("sketch", "fetch", "verify", "filter")

    def amount() -> tuple[int, int]:
        if per_block:
            bl = [index.blocks[t] for t in done]
            nbytes = sum(
                index.blocks[t].stop - index.blocks[t].start
                for t in done
                if index.sources[index.blocks[t].source].format != "parquet"
            )
            return sum(b.docs for b in bl), nbytes
        frac = len(done) / max(len(tasks), 1)
        return int(index.docs * frac), int(index.bytes * frac)

    t0 = time.time()
    report(len(done), len(tasks), *amount(), None, resumed)
    for rec in executor.map(stage, str(wd.root), pending):
        done[int(rec["task"])] = rec
        new = len(done) - resumed
        eta = (time.time() - t0) / new * (len(tasks) - len(done)) if new else None
        report(len(done), len(tasks), *amount(), eta, resumed)
        if cancelled():
            raise InterruptedError("data prep cancelled")
    missing = [t for t in tasks if t not in done]
    if missing:
        raise ItoError(
            ErrorCode.stage_failed, f"data prep stage {stage}: {len(missing)} tasks did not report"
        )
    wd.mark_stage(stage, {"tasks": {str(t): done[t] for t in tasks}})
    return done, resumed


def _publish(wd: WorkDir, output_dir: Path, key: str, shards: list[Shard]) -> None:
    """Move the attempt's shards into ``output_dir`` as a whole (see the docstring)."""
    staged = wd.path("out")
    manifest = output_dir / "manifest.json"
    if not staged.exists():  # published earlier by this same attempt (killed after it)
        if manifest.exists() and json.loads(manifest.read_text()).get("attempt") == key:
            return
        raise ItoError(ErrorCode.stage_failed, f"attempt {key[:12]} has no staged output")
    write_json(staged / "manifest.json", {"attempt": key, "shards": shards})
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
    if output_dir.exists():
        os.replace(output_dir, old)
    os.replace(staged, output_dir)
    shutil.rmtree(old, ignore_errors=True)
