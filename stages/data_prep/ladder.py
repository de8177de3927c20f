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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from scipy.stats import t as student_t

from stages.data_prep.config import LadderProbeConfig
from stages.presets import ModelPreset, load_model_preset
from stages.trainer.model import build_model, causal_lm_loss
from stages.trainer.tokenizer import ByteTokenizer

Decision = Literal["adopt", "reject", "no_decision"]
_WARMUP_FRACTION = 0.1
_MIN_LR_FRACTION = 0.1
_EVAL_BATCH = 32


def token_stream(texts: Sequence[str], tok: ByteTokenizer | None = None) -> np.ndarray:
    """Documents as one stream of byte tokens, each ended by EOS."""
    tok = tok or ByteTokenizer()
    parts = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    eos = np.array([tok.eos_id], dtype=np.int64)
    return np.concatenate([x for p in parts for x in (p, eos)]) if parts else np.zeros(0, np.int64)


def eval_windows(texts: Sequence[str], seq_len: int, max_bytes: int) -> torch.Tensor:
    """Held-out text as (windows, seq_len) byte ids, only bytes (so every predicted
    token is one byte and mean cross-entropy / ln 2 is bits per byte)."""
    data = "\n".join(texts).encode("utf-8")[:max_bytes]
    ids = torch.tensor(list(data), dtype=torch.long)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"eval text has {len(ids)} bytes, fewer than seq_len={seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, windows: torch.Tensor, device: torch.device) -> float:
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(windows), _EVAL_BATCH):
        x = windows[s : s + _EVAL_BATCH].to(device)
        loss = causal_lm_loss(model, x)  # mean over x.size(0) * (seq_len - 1) bytes
        n = x.size(0) * (x.size(1) - 1)
        total += float(loss) * n
        count += n
    model.train()
    return total / count / math.log(2)


def _lr_at(step: int, steps: int, lr: float) -> float:
    warm = max(1, int(steps * _WARMUP_FRACTION))
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return lr * (_MIN_LR_FRACTION + (1 - _MIN_LR_FRACTION) * cosine)


def train_and_score(
    preset: ModelPreset,
    stream: np.ndarray,
    windows: torch.Tensor,
    *,
    seed: int,
    steps: int,
    cfg: LadderProbeConfig,
    device: torch.device,
    cancelled: Callable[[], bool] = lambda: False,
) -> float:
    """Train one proxy from scratch on random windows of ``stream``; return its bpb."""
    if len(stream) <= cfg.seq_len + 1:
        raise ValueError(f"training stream of {len(stream)} tokens is shorter than one window")
    model: torch.nn.Module = build_model(preset, seed=seed)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = torch.from_numpy(stream)
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    offsets = torch.arange(cfg.seq_len)
    for step in range(steps):
        if cancelled():
            raise InterruptedError("ladder probe cancelled")
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, cfg.lr)
        starts = torch.randint(0, len(data) - cfg.seq_len, (cfg.batch_size,), generator=gen)
        x = data[starts[:, None] + offsets].to(device)
        loss = causal_lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return bits_per_byte(model, windows, device)


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
    t_crit = float(student_t.ppf(1 - (1 - confidence) / 2, df=2 * n - 2))
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
    # sha256 of the baseline token stream and of the eval windows: a later probe with
    # the same baseline, eval text and schedule may reuse baseline_bpb (``reuse``).
    baseline_sha256: str = ""
    eval_sha256: str = ""
    rule: str = field(default="t-test on mean bpb difference, pooled seed spread")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


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
) -> LadderResult:
    """Run both arms for ``cfg.seeds`` seeds and decide (see the module docstring).

    ``reuse``: an earlier result whose baseline arm (same baseline tokens, eval text,
    rung, steps and seeds, checked by digest) is taken instead of retrained; the
    baseline arm does not depend on the custom data, so probing several candidate
    datasets against one baseline trains it once."""
    cfg = cfg or LadderProbeConfig()
    t0 = time.time()
    preset = load_model_preset(cfg.rung_preset)
    params = preset.num_params
    budget = cfg.token_budget or int(cfg.tokens_per_param * params)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    steps = max(1, math.ceil(budget / tokens_per_step))
    device = _device(cfg.device)
    base = token_stream(baseline_texts)
    mixed = np.concatenate([base, token_stream(custom_texts)])
    windows = eval_windows(eval_texts, cfg.seq_len, cfg.eval_bytes)
    seeds = list(range(cfg.seeds))
    base_sha = hashlib.sha256(base.tobytes()).hexdigest()
    eval_sha = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
    scores: dict[str, list[float]] = {"baseline": [], "custom": []}
    arms: list[tuple[str, np.ndarray]] = [("custom", mixed)]
    if reuse is not None and _reusable(reuse, preset.name, steps, seeds, base_sha, eval_sha):
        scores["baseline"] = list(reuse.baseline_bpb)
        log("ladder probe: baseline arm reused from an identical earlier probe")
    else:
        arms.insert(0, ("baseline", base))
    for seed in seeds:
        for arm, stream in arms:
            bpb = train_and_score(
                preset,
                stream,
                windows,
                seed=seed,
                steps=steps,
                cfg=cfg,
                device=device,
                cancelled=cancelled,
            )
            scores[arm].append(bpb)
            log(
                f"ladder probe: {arm} seed {seed}: {bpb:.4f} bits/byte "
                f"({steps} steps, {steps * tokens_per_step} tokens, {preset.name})"
            )
    decision, stats = decide(
        scores["baseline"], scores["custom"], cfg.confidence, cfg.min_effect_bpb
    )
    return LadderResult(
        decision=decision,
        preset=preset.name,
        params=params,
        tokens_per_run=steps * tokens_per_step,
        tokens_per_param=steps * tokens_per_step / params,
        steps=steps,
        seeds=seeds,
        baseline_bpb=scores["baseline"],
        custom_bpb=scores["custom"],
        stats=stats,
        custom_token_fraction=1 - len(base) / max(len(mixed), 1),
        eval_bytes=int(windows.numel()),
        seconds=time.time() - t0,
        device=str(device),
        baseline_sha256=base_sha,
        eval_sha256=eval_sha,
    )
