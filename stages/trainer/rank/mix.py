"""A phase's data mix: sequences drawn from each data role by weight, seekable by step.

Slot ``t`` of a rank's sequence stream (batch ``i`` holds slots ``i*B .. i*B+B-1``)
goes to the role whose share of ``[0, 1)`` contains ``frac((t + 1) * φ)`` (a Weyl
sequence): deterministic, stateless and low-discrepancy, so every prefix of the
stream is within a few sequences of the weights. Each role reads its own shuffled,
resumable ``TokenLoader``; the position of every role after ``i`` batches is a pure
function of ``i``, so a restore, a heal or a skipped window is a seek.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.errors import ErrorCode, ItoError
from stages.trainer.rank.data import TokenLoader

_PHI = (5**0.5 - 1) / 2  # golden ratio conjugate
_CHUNK = 1 << 20


class MixedLoader:
    def __init__(
        self,
        role_shards: Mapping[str, Sequence[Path]],
        weights: Mapping[Any, float],
        *,
        seq_len: int,
        micro_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        phase: str = "",
    ):
        roles = sorted(r for r in weights if role_shards.get(r))
        if not roles:
            raise ItoError(
                ErrorCode.data_empty, f"phase {phase}: no data for its roles {sorted(weights)}"
            )
        total = sum(weights[r] for r in roles)
        self.roles = roles
        self.edges = np.cumsum([weights[r] / total for r in roles])
        self.edges[-1] = 1.0
        self.loaders = {
            r: TokenLoader(
                [Path(p) for p in role_shards[r]],
                seq_len=seq_len,
                micro_batch=1,
                seed=seed + 7919 * i,
                dp_rank=dp_rank,
                dp_world=dp_world,
            )
            for i, r in enumerate(roles)
        }
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.phase = phase
        self._batch = 0
        # Nominal, for callers that divide positions into epochs (the mix never wraps).
        self.batches_per_epoch = 1 << 62

    def _roles_of(self, start: int, stop: int) -> np.ndarray:
        t = np.arange(start + 1, stop + 1, dtype=np.float64)
        x = np.mod(t * _PHI, 1.0)
        return np.searchsorted(self.edges, x, side="right").clip(0, len(self.roles) - 1)

    def role_counts(self, slots: int) -> dict[str, int]:
        """Sequences each role served in the first ``slots`` slots."""
        counts = np.zeros(len(self.roles), dtype=np.int64)
        for a in range(0, slots, _CHUNK):
            counts += np.bincount(
                self._roles_of(a, min(slots, a + _CHUNK)), minlength=len(self.roles)
            )
        return {r: int(c) for r, c in zip(self.roles, counts, strict=True)}

    @property
    def batches_served(self) -> int:
        return self._batch

    def seek(self, batch: int) -> None:
        for r, n in self.role_counts(batch * self.micro_batch).items():
            self.loaders[r]._seek(n)
        self._batch = batch

    def next_batch(self) -> torch.Tensor:
        b = self._batch * self.micro_batch
        rows = [
            self.loaders[self.roles[int(k)]].next_batch()[0]
            for k in self._roles_of(b, b + self.micro_batch)
        ]
        self._batch += 1
        return torch.stack(rows)

    # Informational in checkpoints: the loop seeks by step. A state from another phase
    # (the checkpoint that closed the previous one) does not apply and is ignored.
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "batch": self._batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("phase") == self.phase:
            self.seek(int(state["batch"]))
