"""Predicted versus measured peak memory of real training steps on this CPU.

The measurement (stages.trainer.parallel.memory_measure) sums the CPU allocator's allocation
events from torch.profiler into a running peak of the trainer's own step: exact
tensor bytes, no RSS noise. The prediction is the planner's memory model with the
CPU's single-tensor AdamW, in fp32 and in bf16 (which the trainer runs under
``torch.autocast`` over fp32 weights when there is no FSDP; CPU's autocast has the
same weight-cast cache as CUDA's). Configurations vary batch, sequence, recompute,
vocabulary and whether activations or optimizer state dominate.
"""

from __future__ import annotations

import pytest
import torch
from helpers.xdist_groups import module_group

from stages.parallelism.hardware import Precision
from stages.parallelism.memory import estimate_memory
from stages.parallelism.spec import ActivationCheckpointing
from stages.presets import ModelPreset, load_model_preset
from stages.trainer.parallel.memory_measure import measure_peak_memory, measure_step_peak

pytestmark = module_group(__name__)

TOLERANCE = 0.20
# bf16 autocast: the rows land within -1.1%..+2.0% (exact byte counts; what is left
# is small unmodelled tensors). Without the autocast terms (the weight casts, the
# fp32 residual stream, one input cast per projection, the bf16 logits kept through
# the backward) they erred -8% to -22%, so 10% catches a lost term while leaving
# room for what a torch release changes in the ops' saved tensors.
BF16_TOLERANCE = 0.10


def _preset(h: int, ffn: int, layers: int, heads: int, kv: int, vocab: int = 260) -> ModelPreset:
    return ModelPreset(
        name=f"probe-h{h}-l{layers}-v{vocab}",
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
    )


CASES = [
    # (preset, micro_batch, seq_len, recompute); each is a few to tens of MB of tensors,
    # measured exactly, so small models keep the test fast without adding noise
    (load_model_preset("llama-tiny"), 8, 128, "none"),
    (load_model_preset("llama-probe-s"), 4, 256, "none"),
    (_preset(128, 344, 3, 4, 2), 4, 128, "none"),
    (_preset(128, 344, 3, 4, 2), 2, 256, "selective"),
    (_preset(128, 344, 3, 4, 2), 8, 128, "full"),
    (_preset(64, 172, 2, 4, 2, vocab=8192), 2, 128, "none"),  # the loss dominates
    (_preset(256, 688, 2, 4, 2), 1, 32, "none"),  # weights + AdamW dominate
]


def test_measured_peak_is_exact_on_a_known_allocation() -> None:
    """The measuring side alone: a step whose allocations are known byte for byte."""
    p = torch.nn.Parameter(torch.zeros(1000))  # 4,000 B, live before the window
    optimizer = torch.optim.SGD([p], lr=0.1)  # no state

    def step() -> None:
        a = torch.empty(250_000, dtype=torch.float32)  # 1,000,000 B
        b = torch.empty(125_000, dtype=torch.float64)  # 1,000,000 B while a lives
        del a, b
        c = torch.empty(100_000, dtype=torch.uint8)  # after both are freed: no new peak
        del c

    assert measure_step_peak(step, [p], optimizer) == 4_000 + 2_000_000


def test_measured_peak_counts_optimizer_state_and_gradients() -> None:
    p = torch.nn.Parameter(torch.zeros(1000))
    # Momentum: a 4,000 B buffer, made by the warm-up call before the measured one.
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)

    def step() -> None:
        p.grad = torch.ones(1000)  # 4,000 B, freed between calls (set_to_none)
        optimizer.step()
        scratch = torch.empty(250_000)  # 1,000,000 B
        del scratch

    assert measure_step_peak(step, [p], optimizer) == 3 * 4_000 + 1_000_000


def _predicted(
    preset: ModelPreset,
    micro_batch: int,
    seq_len: int,
    recompute: ActivationCheckpointing,
    precision: Precision,
) -> float:
    return estimate_memory(
        preset,
        seq_len=seq_len,
        micro_batch=micro_batch,
        microbatches=1,
        tp=1,
        cp=1,
        fsdp=1,
        dp_replicate=1,
        pp_stage_layers=[preset.num_hidden_layers],
        pp_schedule="1F1B",
        pp_virtual_stages=1,
        activation_checkpointing=recompute,
        precision=precision,
        foreach_optimizer=False,
    ).total


_IDS = [f"{c[0].name}-b{c[1]}-s{c[2]}-{c[3]}" for c in CASES]


@pytest.mark.parametrize(("preset", "micro_batch", "seq_len", "recompute"), CASES, ids=_IDS)
def test_predicted_peak_within_20_percent_of_measured(
    preset: ModelPreset, micro_batch: int, seq_len: int, recompute: ActivationCheckpointing
) -> None:
    measured = measure_peak_memory(
        preset, micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=recompute
    )
    predicted = _predicted(preset, micro_batch, seq_len, recompute, "fp32")
    assert measured > 1e6, "configs must be big enough for the comparison to mean something"
    assert abs(predicted - measured) / measured <= TOLERANCE, (
        f"predicted {predicted / 1e6:.1f} MB vs measured {measured / 1e6:.1f} MB"
    )


@pytest.mark.parametrize(("preset", "micro_batch", "seq_len", "recompute"), CASES, ids=_IDS)
def test_bf16_autocast_predicted_peak_within_10_percent_of_measured(
    preset: ModelPreset, micro_batch: int, seq_len: int, recompute: ActivationCheckpointing
) -> None:
    """The trainer's bf16 step without FSDP: ``ParallelModel`` under ``torch.autocast``."""
    measured = measure_peak_memory(
        preset,
        micro_batch=micro_batch,
        seq_len=seq_len,
        activation_checkpointing=recompute,
        precision="bf16",
    )
    predicted = _predicted(preset, micro_batch, seq_len, recompute, "bf16")
    assert measured > 1e6
    assert abs(predicted - measured) / measured <= BF16_TOLERANCE, (
        f"predicted {predicted / 1e6:.1f} MB vs measured {measured / 1e6:.1f} MB"
    )


# --- TP and PP: each rank its own process on gloo ------------------------------------
# Measured the same way on every rank (tests/trainer/parallel_cases.py, the trainer's
# own ParallelModel) on the lm objective; predicted for TP as it runs on CPU: no
# sequence parallel (on on GPU), the loss on vocab-sharded logits (loss parallel).


@pytest.fixture(scope="module")
def parallel_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    import torch

    from tests.trainer.parallel_cases import MEM_CASES, launch

    out = tmp_path_factory.mktemp("mem")
    launch(2, list(MEM_CASES), out)
    return {
        name: [int(torch.load(out / f"{name}-rank{r}.pt")["peak"]) for r in range(2)]
        for name in MEM_CASES
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mem_tp2", "mem_pp2", "mem_pp2_gpipe"])
def test_tp_and_pp_predicted_peak_within_20_percent_of_measured(
    parallel_peaks: dict[str, list[int]], case: str
) -> None:
    from stages.trainer.parallel.layout import ParallelLayout
    from tests.trainer.parallel_cases import MEM_CASES, MEM_PRESET, MEM_SEQ_LEN, MEM_SEQS

    layout = ParallelLayout(**MEM_CASES[case]).resolved(2)
    mbs = layout.pp_microbatches
    predicted = estimate_memory(
        MEM_PRESET,
        seq_len=MEM_SEQ_LEN,
        micro_batch=MEM_SEQS // mbs,
        microbatches=mbs,
        tp=layout.tp,
        cp=1,
        fsdp=1,
        dp_replicate=1,
        pp_stage_layers=layout.stage_layers(MEM_PRESET.num_hidden_layers),
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=1,
        activation_checkpointing="none",
        precision="fp32",
        foreach_optimizer=False,
        sequence_parallel=False,
    ).total
    # the planner predicts the busiest rank
    measured = max(parallel_peaks[case])
    assert measured > 1e7
    assert abs(predicted - measured) / measured <= TOLERANCE, (
        f"predicted {predicted / 1e6:.1f} MB vs measured {measured / 1e6:.1f} MB"
    )
