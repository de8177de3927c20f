"""Run a battery on an in-memory model: every check, each bounded in time.

A check that raises, times out or gives no finite number is recorded as such, with
no score; the gate treats it as failed (never as a pass).
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import BaseModel

from stages.evals.config import Battery, BatteryCheck, evals_dir, load_battery
from stages.evals.config import EvalRunSettings as EvalSettings
from stages.evals.harness import run_tasks, task_data_files
from stages.evals.heldout import HeldoutSums, heldout_scores

if TYPE_CHECKING:  # the driver decides gates here; the ranks run the model
    import torch
    from transformers import PreTrainedTokenizerBase

CheckStatus = Literal["ok", "error", "timeout", "no_number"]


class CheckResult(BaseModel):
    name: str
    kind: str
    metric: str
    higher_is_better: bool
    score: float | None
    status: CheckStatus
    error: str = ""
    seconds: float = 0.0


class BatteryResult(BaseModel):
    battery: str
    phase: str = ""
    step: int | None = None
    checks: list[CheckResult]
    # configs/evals-relative path -> sha256 of the battery file, task YAMLs and data.
    task_files: dict[str, str]
    started_at: float
    seconds: float

    def scores(self) -> dict[str, float]:
        return {c.name: c.score for c in self.checks if c.score is not None}

    def check(self, name: str) -> CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def battery_files(battery: Battery) -> dict[str, str]:
    """sha256 of every file the battery's numbers depend on."""
    root = evals_dir().resolve()
    paths = [root / f"{battery.name}.json"]
    for task in battery.task_paths():
        paths += [task.resolve(), *task_data_files(task)]
    out: dict[str, str] = {}
    for p in paths:
        try:
            key = str(p.relative_to(root))
        except ValueError:
            key = str(p)
        out[key] = _sha256(p) if p.is_file() else "missing"
    return out


_T = TypeVar("_T")


def _bounded(fn: Callable[[], _T], timeout_s: float) -> _T:
    """Run ``fn`` in a worker thread, at most ``timeout_s``. On timeout the thread is
    abandoned (Python cannot kill it); the caller fails the gate and stops using the
    model, so its late writes go nowhere."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ito-eval")
    try:
        return pool.submit(fn).result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _record(
    checks: Sequence[BatteryCheck], fn: Callable[[], dict[str, float | None]], timeout_s: float
) -> list[CheckResult]:
    t0 = time.time()
    status: CheckStatus = "ok"
    error = ""
    values: dict[str, float | None] = {}
    try:
        values = _bounded(fn, timeout_s)
    except FutureTimeout:
        status, error = "timeout", f"no result within {timeout_s:g} s"
    except Exception as e:  # any crash of an eval is a failed check, with its reason
        status, error = "error", f"{type(e).__name__}: {str(e)[:300]}"
    dt = time.time() - t0
    out = []
    for c in checks:
        score = values.get(c.name)
        st, err = status, error
        if st == "ok" and (score is None or not math.isfinite(score)):
            st, err, score = "no_number", f"no finite {c.metric} in the result", None
        out.append(
            CheckResult(
                name=c.name,
                kind=c.kind,
                metric=c.metric,
                higher_is_better=c.higher_is_better,
                score=score if st == "ok" else None,
                status=st,
                error=err,
                seconds=dt / len(checks),
            )
        )
    return out


def lm_eval_tasks(battery: Battery) -> dict[str, list[BatteryCheck]]:
    """The battery's lm-eval checks by task (a task's checks are scored by one run)."""
    by_task: dict[str, list[BatteryCheck]] = {}
    for c in battery.checks:
        if c.kind == "lm_eval" and c.task:
            by_task.setdefault(c.task, []).append(c)
    return dict(sorted(by_task.items()))


def _max_length(model: torch.nn.Module, s: EvalSettings) -> int:
    return s.max_length or int(
        getattr(getattr(model, "config", None), "max_position_embeddings", 2048)
    )


def run_task_checks(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    checks: list[BatteryCheck],
    *,
    settings: EvalSettings,
    work_dir: Path | None = None,
) -> list[CheckResult]:
    """One lm-eval task of a battery on ``model``: its checks, bounded in time."""
    s = settings
    # A timed-out check's thread may still write here: removal must not fail on it.
    tmp = tempfile.TemporaryDirectory(
        prefix="ito-lmeval-", dir=work_dir, ignore_cleanup_errors=True
    )

    def _task() -> dict[str, float | None]:
        got = run_tasks(
            model,
            tokenizer,
            [evals_dir() / task],
            include_dir=Path(tmp.name),
            max_length=_max_length(model, s),
            batch_size=s.batch_size,
            limit=s.limit,
            seed=s.seed,
        )
        metrics = next(iter(got.values()), {})
        return {c.name: metrics.get(f"{c.metric},{c.filter}") for c in checks}

    try:
        return _record(checks, _task, s.check_timeout_s)
    finally:
        tmp.cleanup()


def run_battery(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    battery_name: str,
    heldout_texts: Sequence[str],
    *,
    seq_len: int,
    phase: str = "",
    step: int | None = None,
    settings: EvalSettings | None = None,
    work_dir: Path | None = None,
    heldout_sums: HeldoutSums | None = None,
    task_checks: Sequence[CheckResult] | None = None,
) -> BatteryResult:
    """Every check of the battery on ``model`` (left in the train/eval mode it was in).
    ``heldout_sums``: the held-out windows already scored over the data-parallel
    ranks and reduced (``stages.evals.heldout``); None: ``model`` scores them all.
    ``task_checks``: the lm-eval checks already run elsewhere (``run_task_checks`` on
    other ranks); None: ``model`` runs them."""
    s = settings or EvalSettings()
    battery = load_battery(battery_name)
    started = time.time()
    files = battery_files(battery)
    results: list[CheckResult] = []

    held = [c for c in battery.checks if c.kind == "heldout"]
    if held:

        def _held() -> dict[str, float | None]:
            if heldout_sums is not None:
                return {c.name: heldout_sums.scores().get(c.metric) for c in held}
            got = heldout_scores(
                model,
                tokenizer,
                heldout_texts,
                seq_len=s.heldout_seq_len or seq_len,
                max_tokens=s.heldout_max_tokens,
                batch_size=s.batch_size,
            )
            return {c.name: got.get(c.metric) for c in held}

        results += _record(held, _held, s.check_timeout_s)

    ran = {c.name: c for c in task_checks or ()}
    for task, checks in lm_eval_tasks(battery).items():
        if task_checks is not None:
            missing = [c.name for c in checks if c.name not in ran]
            if missing:
                raise ValueError(f"battery {battery.name}: check {missing[0]} was not run")
            results += [ran[c.name] for c in checks]
        else:
            results += run_task_checks(
                model, tokenizer, task, checks, settings=s, work_dir=work_dir
            )

    order = {c.name: i for i, c in enumerate(battery.checks)}
    results.sort(key=lambda r: order[r.name])
    return BatteryResult(
        battery=battery.name,
        phase=phase,
        step=step,
        checks=results,
        task_files=files,
        started_at=started,
        seconds=time.time() - started,
    )
