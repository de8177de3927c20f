"""Fixtures for checkpointing tests: a tiny real training loop over real shards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from stages.checkpointing import CheckpointPolicy
from stages.model.lm import build_model, causal_lm_loss
from stages.model.tokenizer import ByteTokenizer
from stages.presets import load_model_preset
from stages.trainer.rank.data import TokenLoader, build_token_shards
from stages.trainer.rank.train_state import TrainState

SEQ, MB, SEED = 32, 2, 4321


@dataclass
class Tiny:
    shards: list[Path]
    seed: int = SEED

    def state(self, model_seed: int = SEED) -> TrainState:
        model = build_model(load_model_preset("llama-tiny"), seed=model_seed)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = TokenLoader(self.shards, seq_len=SEQ, micro_batch=MB, seed=SEED)
        return TrainState(model, opt, loader=loader)

    def train(
        self, state: TrainState, steps: int, between: Callable[[TrainState], None] | None = None
    ) -> list[float]:
        """``between(state)`` runs after each committed step (where a loop saves)."""
        losses = []
        for _ in range(steps):
            batch = state.loader.next_batch()  # type: ignore[union-attr]
            labels = batch.clone()
            labels[torch.rand(labels.shape) < 0.1] = -100  # draws from the torch RNG
            loss = causal_lm_loss(state.model, batch, labels)
            loss.backward()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.step += 1
            losses.append(loss.item())
            if between is not None:
                between(state)
        return losses


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("ckpt_data")
    src = tmp / "corpus.txt"
    src.write_text(
        "".join(f"record {i}: checkpoints must be exact {i * 31 % 17}\n" for i in range(300))
    )
    return build_token_shards([src], tmp / "shards", tokenizer=ByteTokenizer(), shard_tokens=2048)


@pytest.fixture
def tiny(tiny_shards: list[Path]) -> Iterator[Tiny]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield Tiny(tiny_shards)
    torch.use_deterministic_algorithms(was)


@pytest.fixture
def policy(tmp_path: Path) -> Callable[..., CheckpointPolicy]:
    def make(**kw: object) -> CheckpointPolicy:
        kw.setdefault("interval_steps", 2)
        return CheckpointPolicy(storage_uri=f"file://{tmp_path / 'ckpt'}", **kw)  # type: ignore[arg-type]

    return make
