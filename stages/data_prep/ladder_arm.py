"""One ladder-probe proxy: a rung model trained from scratch on one arm's token
stream and scored in bits per byte (the torch side of ``stages.data_prep.ladder``;
it runs where the stage puts it: a Ray task on the run's booked nodes, or in-process
when the stage runs alone)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from stages.data_prep.config import LadderProbeConfig
from stages.data_prep.ladder_jobs import ArmJob
from stages.model.lm import build_model, causal_lm_loss
from stages.presets import ModelPreset, load_model_preset

_WARMUP_FRACTION = 0.1
_MIN_LR_FRACTION = 0.1
_EVAL_BATCH = 32


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def score_arm(
    job: ArmJob,
    stream: np.ndarray,
    windows: np.ndarray,
    cfg: LadderProbeConfig,
    *,
    cancelled: Callable[[], bool] = lambda: False,
) -> tuple[float, str]:
    """``job``'s proxy trained on ``stream`` and scored on ``windows``: (bpb, device)."""
    device = _device(cfg.device)
    bpb = train_and_score(
        load_model_preset(cfg.rung_preset),
        stream,
        torch.from_numpy(np.ascontiguousarray(windows)),
        seed=job.seed,
        steps=job.steps,
        cfg=cfg,
        device=device,
        cancelled=cancelled,
    )
    return bpb, str(device)


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
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return bits_per_byte(model, windows, device)
