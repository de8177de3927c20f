"""TrainState: resume through DCP is step-for-step identical to no restart."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from stages.errors import ErrorCode, ItoError
from stages.model.lm import build_model, causal_lm_loss
from stages.model.tokenizer import ByteTokenizer
from stages.presets import load_model_preset
from stages.trainer.rank.data import TokenLoader, build_token_shards
from stages.trainer.rank.train_state import TrainState, set_determinism

SEQ, MB, SEED = 32, 2, 1234


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("data")
    src = tmp / "corpus.txt"
    src.write_text(
        "".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps\n" for i in range(400))
    )
    return build_token_shards([src], tmp / "shards", tokenizer=ByteTokenizer(), shard_tokens=4096)


def make_state(shards: list[Path], model_seed: int) -> TrainState:
    model = build_model(load_model_preset("llama-tiny"), seed=model_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    loader = TokenLoader(shards, seq_len=SEQ, micro_batch=MB, seed=SEED)
    return TrainState(model, opt, loader=loader, lr_scheduler=sched)


def train(state: TrainState, steps: int) -> list[float]:
    """A tiny loop that also draws from every RNG, so an unrestored RNG shows."""
    assert state.loader is not None and state.lr_scheduler is not None
    losses = []
    for _ in range(steps):
        batch = state.loader.next_batch()  # type: ignore[attr-defined]
        labels = batch.clone()
        labels[torch.rand(labels.shape) < 0.1] = -100  # torch RNG
        if np.random.rand() < 0.5:  # numpy RNG
            labels[:, : 1 + random.randrange(3)] = -100  # python RNG
        loss = causal_lm_loss(state.model, batch, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
        state.optimizer.step()
        state.lr_scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        losses.append(loss.item())
    return losses


def test_resume_is_step_for_step_identical(shards: list[Path], tmp_path: Path) -> None:
    set_determinism(SEED)
    reference = train(make_state(shards, model_seed=SEED), 8)

    set_determinism(SEED)
    first = make_state(shards, model_seed=SEED)
    before = train(first, 4)
    dcp.save({"train": first}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert before == reference[:4]

    # A different process would start from other weights and other RNG states.
    set_determinism(SEED + 99)
    torch.rand(1000)
    resumed = make_state(shards, model_seed=SEED + 1)
    dcp.load({"train": resumed}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert resumed.step == 4
    after = train(resumed, 4)
    assert after == reference[4:], (after, reference[4:])


def test_deterministic_kernels_without_the_nan_fill() -> None:
    """Deterministic kernels, but no NaN fill of every new tensor (3-7% of a CPU step)."""
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    set_determinism(SEED)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is False  # type: ignore[attr-defined]


def test_rng_is_part_of_the_state(shards: list[Path], tmp_path: Path) -> None:
    """Without the RNG restore the losses would differ: the check above is not vacuous."""
    set_determinism(SEED)
    reference = train(make_state(shards, model_seed=SEED), 6)
    set_determinism(SEED)
    first = make_state(shards, model_seed=SEED)
    train(first, 3)
    dcp.save({"train": first}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    resumed = make_state(shards, model_seed=SEED)
    dcp.load({"train": resumed}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    torch.manual_seed(7)  # disturb the torch RNG after the restore
    assert train(resumed, 3) != reference[3:]


def test_missing_entries_are_a_corrupt_checkpoint(shards: list[Path]) -> None:
    state = make_state(shards, model_seed=0)
    sd = state.state_dict()
    del sd["loader"]
    with pytest.raises(ItoError) as e:
        state.load_state_dict(sd)
    assert e.value.code == ErrorCode.checkpoint_corrupt
