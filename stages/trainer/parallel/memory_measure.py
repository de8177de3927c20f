"""Measure real peak memory of one training step on CPU, to check the memory model.

How: one warm-up step creates AdamW's state; the measured step then runs under
``torch.profiler`` with ``profile_memory=True``, which records every allocation and
free of the CPU allocator with its byte count and time. Sorting those events and
taking the running sum's maximum gives the step's peak above what was live before
it; adding the tensors already live (weights + optimizer state, counted exactly)
gives the peak of allocated tensor bytes. This counts what the memory model
predicts (tensor bytes), not RSS: no allocator caching, library or interpreter
noise, and it is exact to the byte, so a 20% tolerance tests the model, not noise.

The planner's memory model (``stages.parallelism``) is checked against it in tests;
it lives with the trainer because it runs the trainer's own step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from stages.parallelism.hardware import Precision
from stages.parallelism.spec import ActivationCheckpointing
from stages.presets import ModelPreset


def _live_bytes(tensors: Iterable[object]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def measure_peak_memory(
    preset: ModelPreset,
    *,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: ActivationCheckpointing = "none",
    precision: Precision = "fp32",
    seed: int = 0,
) -> int:
    """Peak bytes of live tensors during one training step of ``preset`` on CPU as the
    trainer runs it on one rank (steady state: the optimizer state already exists):
    ``ParallelModel`` (bf16 under ``torch.autocast`` over fp32 weights), the LM
    objective's forward and backward, gradient clipping and a single-tensor AdamW."""
    from stages.model.lm import build_model
    from stages.trainer.parallel.layout import ParallelLayout
    from stages.trainer.parallel.parallelize import ParallelModel
    from stages.trainer.rank.objective import LanguageModelObjective

    model = build_model(preset, seed=seed)
    model.train()
    layout = ParallelLayout(precision=precision, activation_checkpointing=activation_checkpointing)
    pm = ParallelModel(model, layout, None, torch.device("cpu"))
    optimizer = torch.optim.AdamW(pm.module.parameters(), lr=1e-4, foreach=False)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, preset.vocab_size, (micro_batch, seq_len), generator=generator)
    batch = LanguageModelObjective.batch_of(ids)
    objective = LanguageModelObjective(loader=None)

    def step() -> None:
        pm.forward_backward(batch, objective)
        pm.clip_grad_norm_(1.0)
        optimizer.step()

    return measure_step_peak(step, pm.module.parameters(), optimizer)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else t
    return local


def measure_step_peak(
    step: Callable[[], None], params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer
) -> int:
    """Peak bytes of live tensors during ``step()`` (forward, backward and optimizer
    step of whatever layout), after one warm-up call. DTensors count their local
    shard: this is one rank's peak."""
    from torch.profiler import ProfilerActivity, profile

    tensors = list(params)
    step()
    # Free gradients outside the profiled window: frees of blocks allocated before
    # profiling are not reported, so they must not happen inside it.
    optimizer.zero_grad(set_to_none=True)
    before = _live_bytes(_local(p) for p in tensors) + _live_bytes(
        _local(v) for state in optimizer.state.values() for v in state.values()
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    running = functools.reduce(
        lambda acc, ev: (acc[0] + ev[1], max(acc[1], acc[0] + ev[1])), events, (0, 0)
    )
    return before + running[1]
