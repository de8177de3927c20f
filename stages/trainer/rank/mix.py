"""A phase's data mix: sequences drawn from each data role by weight, seekable by step.

The step's global batch is a block of ``B`` slots of one run-wide sequence stream:
batch ``i`` holds slots ``i*B .. i*B+B-1``, and data-parallel rank ``d`` of ``W``
trains the slots ``i*B + d + W*k`` (``B/W`` of them). Slot ``t`` goes to the role whose
share of ``[0, 1)`` contains ``frac((t + 1) * φ)`` (a Weyl sequence): deterministic,
stateless and low-discrepancy, so every prefix of the stream is within a few sequences
of the weights. A role's ``n``-th slot reads its ``n``-th window, from its own
shuffled ``TokenLoader``. Every position is a pure function of the batch index, so a
restore, a heal or a skipped window is a seek; and since the stream is the run's, not
a rank's, the cut (``cut``) may change between two steps (a resize of the run's
replica groups) without a sequence read twice or skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.curriculum.config import DataRole
from stages.errors import ErrorCode, ItoError
from stages.trainer.rank.data import TokenLoader

_PHI = (5**0.5 - 1) / 2  # golden ratio conjugate
_CHUNK = 1 << 20


class MixedLoader:
    def __init__(
        self,
        role_shards: Mapping[str, Sequence[Path]],
        weights: Mapping[DataRole, float],
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
            )
            for i, r in enumerate(roles)
        }
        self.seq_len = seq_len
        # Sequences a step trains over every rank: fixed for the phase, whatever the cut.
        self.global_batch = micro_batch * dp_world
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.phase = phase
        self._batch = 0
        # Role counts over the slots before batch ``_counted`` (a step's seek is O(B)).
        self._counted = 0
        self._counts = np.zeros(len(roles), dtype=np.int64)
        # Nominal, for callers that divide positions into epochs (the mix never wraps).
        self.batches_per_epoch = 1 << 62

    @property
    def micro_batch(self) -> int:
        """This rank's sequences a step."""
        return self.global_batch // self.dp_world

    def cut(self, dp_rank: int, dp_world: int) -> None:
        """Train rank ``dp_rank`` of ``dp_world``'s share of each step from now on."""
        if dp_world <= 0 or self.global_batch % dp_world or not 0 <= dp_rank < dp_world:
            raise ItoError(
                ErrorCode.resize_refused,
                f"phase {self.phase}: a global batch of {self.global_batch} sequences does "
                f"not split into {dp_world} equal shares (rank {dp_rank})",
            )
        self.dp_rank, self.dp_world = dp_rank, dp_world

    def _roles_of(self, start: int, stop: int) -> np.ndarray:
        t = np.arange(start + 1, stop + 1, dtype=np.float64)
        x = np.mod(t * _PHI, 1.0)
        return np.searchsorted(self.edges, x, side="right").clip(0, len(self.roles) - 1)

    def role_counts(self, slots: int) -> dict[str, int]:
        """Sequences each role served in the first ``slots`` slots."""
        counts = self._count(0, slots)
        return {r: int(c) for r, c in zip(self.roles, counts, strict=True)}

    def _count(self, start: int, stop: int) -> np.ndarray:
        counts = np.zeros(len(self.roles), dtype=np.int64)
        for a in range(start, stop, _CHUNK):
            counts += np.bincount(
                self._roles_of(a, min(stop, a + _CHUNK)), minlength=len(self.roles)
            )
        return counts

    def _counts_before(self, batch: int) -> np.ndarray:
        """Each role's slots before batch ``batch``'s block."""
        b = self.global_batch
        if batch >= self._counted:
            self._counts = self._counts + self._count(self._counted * b, batch * b)
        else:
            self._counts = self._count(0, batch * b)
        self._counted = batch
        return self._counts

    @property
    def batches_served(self) -> int:
        return self._batch

    def seek(self, batch: int) -> None:
        self._batch = batch

    def next_batch(self) -> torch.Tensor:
        start = self._batch * self.global_batch
        roles = self._roles_of(start, start + self.global_batch)
        seen = self._counts_before(self._batch).copy()
        mine = set(range(self.dp_rank, self.global_batch, self.dp_world))
        rows = []
        for j, k in enumerate(roles):
            if j in mine:
                loader = self.loaders[self.roles[int(k)]]
                loader._seek(int(seen[k]))
                rows.append(loader.next_batch()[0])
            seen[k] += 1
        self._batch += 1
        return torch.stack(rows)

    # Informational in checkpoints: the loop seeks by step. A state from another phase
    # (the checkpoint that closed the previous one) does not apply and is ignored.
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "batch": self._batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("phase") == self.phase:
            self.seek(int(state["batch"]))
