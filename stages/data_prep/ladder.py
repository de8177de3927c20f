"""The ladder probe: is the custom data worth training on?

Small proxy models of one rung (a preset; ``llama-150m`` on GPUs, ``llama-probe-xs``
on the CPU testbed) are trained from scratch twice per seed: on the baseline data
alone, and on baseline + custom data, each for the same number of tokens (equal
tokens per parameter), then scored in bits per byte on held-out eval text (the eval
suites' items, which decontamination has just removed from the training data).

Decision rule (``decide``): with n seeds per arm, d = mean(custom) - mean(baseline)
(negative: custom helps), s_p = sqrt((s_b^2 + s_c^2) / 2) the pooled seed standard
deviation, se = s_p * sqrt(2 / n), and margin = max(t_{conf, 2n-2} * se,
min_effect_bpb). ``adopt`` if d <= -margin, ``reject`` if d >= margin, otherwise
``no_decision``: a two-sample t-test at the configured confidence, plus a floor so
that a seed spread of ~0 cannot turn a negligible difference into a decision.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from stages.data_prep.config import LadderProbeConfig
from stages.data_prep.ladder_jobs import IN_PROCESS, ArmJob, ArmRunner
from stages.model.tokenizer import ByteTokenizer
from stages.presets import load_model_preset

Decision = Literal["adopt", "reject", "no_decision"]


def token_stream(texts: Sequence[str], tok: ByteTokenizer | None = None) -> np.ndarray:
    """Documents as one stream of byte tokens, each ended by EOS."""
    tok = tok or ByteTokenizer()
    parts = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    eos = np.array([tok.eos_id], dtype=np.int64)
    return np.concatenate([x for p in parts for x in (p, eos)]) if parts else np.zeros(0, np.int64)


def eval_ids(texts: Sequence[str], seq_len: int, max_bytes: int) -> np.ndarray:
    """Held-out text as (windows, seq_len) byte ids, only bytes (so every predicted
    token is one byte and mean cross-entropy / ln 2 is bits per byte)."""
    data = np.frombuffer("\n".join(texts).encode("utf-8")[:max_bytes], dtype=np.uint8)
    n = len(data) // seq_len
    if n == 0:
        raise ValueError(f"eval text has {len(data)} bytes, fewer than seq_len={seq_len}")
    return data[: n * seq_len].astype(np.int64).reshape(n, seq_len)


def local_runner(cancelled: Callable[[], bool] = lambda: False) -> ArmRunner:
    """Every arm in this process, one after the other (a stage run alone, tests)."""

    def run(
        jobs: list[ArmJob],
        streams: dict[str, np.ndarray],
        windows: np.ndarray,
        cfg: LadderProbeConfig,
    ) -> Iterator[tuple[ArmJob, float, str, str]]:
        from stages.data_prep.ladder_arm import score_arm

        for job in jobs:
            bpb, device = score_arm(job, streams[job.arm], windows, cfg, cancelled=cancelled)
            yield job, bpb, device, IN_PROCESS

    return run


def t_critical(confidence: float, n: int) -> float:
    """The two-sided t quantile at ``confidence`` for n seeds per arm (2n - 2 degrees of
    freedom)."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(1 - (1 - confidence) / 2, df=2 * n - 2))


def decide(
    baseline: Sequence[float], custom: Sequence[float], confidence: float, min_effect: float
) -> tuple[Decision, dict[str, float]]:
    """The rule in the module docstring; returns the decision and its numbers."""
    b, c = np.asarray(baseline, float), np.asarray(custom, float)
    n = min(len(b), len(c))
    if n < 2:
        raise ValueError("the decision needs at least 2 seeds per arm")
    delta = float(c.mean() - b.mean())
    pooled = float(math.sqrt((b.var(ddof=1) + c.var(ddof=1)) / 2))
    se = pooled * math.sqrt(2 / n)
    t_crit = t_critical(confidence, n)
    margin = max(t_crit * se, min_effect)
    decision: Decision = (
        "adopt" if delta <= -margin else "reject" if delta >= margin else "no_decision"
    )
    return decision, {
        "delta_bpb": delta,
        "pooled_std_bpb": pooled,
        "stderr_bpb": se,
        "t_critical": t_crit,
        "margin_bpb": margin,
        "baseline_bpb_mean": float(b.mean()),
        "custom_bpb_mean": float(c.mean()),
    }


@dataclass
class LadderResult:
    decision: Decision
    preset: str
    params: int
    tokens_per_run: int
    tokens_per_param: float
    steps: int
    seeds: list[int]
    baseline_bpb: list[float]
    custom_bpb: list[float]
    stats: dict[str, float]
    custom_token_fraction: float
    eval_bytes: int
    seconds: float
    device: str
    # Where the proxies trained: trainer ranks ("rg0/rank0") or "in-process".
    trained_on: list[str] = field(default_factory=list)
    # sha256 of the baseline token stream and of the eval windows: a later probe with
    # the same baseline, eval text and schedule may reuse baseline_bpb (``reuse``).
    baseline_sha256: str = ""
    eval_sha256: str = ""
    rule: str = field(default="t-test on mean bpb difference, pooled seed spread")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _reusable(
    prev: LadderResult | None,
    preset: str,
    steps: int,
    seeds: list[int],
    base_sha: str,
    eval_sha: str,
) -> bool:
    return (
        prev is not None
        and prev.preset == preset
        and prev.steps == steps
        and prev.seeds == seeds
        and prev.baseline_sha256 == base_sha
        and prev.eval_sha256 == eval_sha
    )


def ladder_probe(
    baseline_texts: Sequence[str],
    custom_texts: Sequence[str],
    eval_texts: Sequence[str],
    cfg: LadderProbeConfig | None = None,
    *,
    reuse: LadderResult | None = None,
    log: Callable[[str], None] = lambda _m: None,
    cancelled: Callable[[], bool] = lambda: False,
    run_arms: ArmRunner | None = None,
) -> LadderResult:
    """Run both arms for ``cfg.seeds`` seeds and decide (see the module docstring).

    ``reuse``: an earlier result whose baseline arm (same baseline tokens, eval text,
    rung, steps and seeds, checked by digest) is taken instead of retrained; the
    baseline arm does not depend on the custom data, so probing several candidate
    datasets against one baseline trains it once. ``run_arms`` trains the proxies
    (default: in this process; in a run the stage passes one that trains them on the
    run's trainer ranks, ``stages.data_prep.ladder_ranks``)."""
    cfg = cfg or LadderProbeConfig()
    t0 = time.time()
    preset = load_model_preset(cfg.rung_preset)
    params = preset.num_params
    budget = cfg.token_budget or int(cfg.tokens_per_param * params)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    steps = max(1, math.ceil(budget / tokens_per_step))
    base = token_stream(baseline_texts)
    mixed = np.concatenate([base, token_stream(custom_texts)])
    for stream in (base, mixed):
        if len(stream) <= cfg.seq_len + 1:
            raise ValueError(f"training stream of {len(stream)} tokens is shorter than one window")
    windows = eval_ids(eval_texts, cfg.seq_len, cfg.eval_bytes)
    seeds = list(range(cfg.seeds))
    base_sha = hashlib.sha256(base.tobytes()).hexdigest()
    eval_sha = hashlib.sha256(windows.tobytes()).hexdigest()
    scores: dict[str, dict[int, float]] = {"baseline": {}, "custom": {}}
    arms = ["custom"]
    if reuse is not None and _reusable(reuse, preset.name, steps, seeds, base_sha, eval_sha):
        scores["baseline"] = dict(zip(seeds, reuse.baseline_bpb, strict=True))
        log("ladder probe: baseline arm reused from an identical earlier probe")
    else:
        arms.insert(0, "baseline")
    jobs = [ArmJob(arm, seed, steps) for seed in seeds for arm in arms]
    runner = run_arms or local_runner(cancelled)
    devices: set[str] = set()
    places: set[str] = set()
    streams = {"baseline": base, "custom": mixed}
    for done, (job, bpb, device, where) in enumerate(runner(jobs, streams, windows, cfg)):
        if done == 0 and len(seeds) >= 2:
            # The decision's quantile imports scipy.stats (a second on a loaded host):
            # here, while the other proxies train, not after the last one.
            t_critical(cfg.confidence, len(seeds))
        scores[job.arm][job.seed] = bpb
        devices.add(device)
        places.add(where)
        log(
            f"ladder probe: {job.arm} seed {job.seed}: {bpb:.4f} bits/byte "
            f"({steps} steps, {steps * tokens_per_step} tokens, {preset.name}, {where})"
        )
    baseline = [scores["baseline"][s] for s in seeds]
    custom = [scores["custom"][s] for s in seeds]
    decision, stats = decide(baseline, custom, cfg.confidence, cfg.min_effect_bpb)
    return LadderResult(
        decision=decision,
        preset=preset.name,
        params=params,
        tokens_per_run=steps * tokens_per_step,
        tokens_per_param=steps * tokens_per_step / params,
        steps=steps,
        seeds=seeds,
        baseline_bpb=baseline,
        custom_bpb=custom,
        stats=stats,
        custom_token_fraction=1 - len(base) / max(len(mixed), 1),
        eval_bytes=int(windows.size),
        seconds=time.time() - t0,
        device=",".join(sorted(devices)) or (reuse.device if reuse is not None else ""),
        trained_on=sorted(places),
        baseline_sha256=base_sha,
        eval_sha256=eval_sha,
    )
