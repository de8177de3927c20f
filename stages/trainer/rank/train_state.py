"""Everything a resume needs, as one DCP ``Stateful``.

``TrainState`` bundles the model, optimizer, optional LR scheduler, the data
loader position, the step counter, RNG states (torch CPU, CUDA when present,
numpy, python ``random``) and any extra ``Stateful`` (e.g. the loss-spike
detector). Model and optimizer go through
``torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict``
(torchtitan's pattern), so FQN-keyed, resharding-safe state is saved whether the
model is plain, DDP-wrapped or FSDP2-sharded.

Per-rank pieces (RNG, loader) are keyed by rank: DCP keeps one copy of a
non-tensor value per key across ranks, so a shared key would silently keep only
one rank's RNG.
"""

from __future__ import annotations

import os
import random
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from stages.errors import ErrorCode, ItoError


@runtime_checkable
class _HasState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def set_determinism(seed: int, *, deterministic: bool = True) -> None:
    """Seed torch / numpy / random and (optionally) force deterministic kernels.

    Call once per process before building the model. With ``deterministic`` the
    same seed gives bit-identical CPU runs; on CUDA it also sets the cuBLAS
    workspace so deterministic matmuls are allowed.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        # Deterministic mode also fills every new tensor with NaN (a debugging aid
        # against reads of uninitialised memory): 3-7% of a CPU step at llama-25m,
        # paid on every allocation. No kernel reads uninitialised memory, so the
        # results are the same without it (PyTorch's ``torch.utils.deterministic``).
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]  # a module property
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState(Stateful):
    """A DCP ``Stateful`` over the whole training state of one rank.

    ``optimizer`` must be a plain ``torch.optim.Optimizer`` (for torchft, pass the
    optimizer inside ``OptimizerWrapper``). ``rank`` is this rank's index within
    its (replica) group; ``step`` is read and written by the training loop.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loader: _HasState | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        extras: dict[str, _HasState] | None = None,
        step: int = 0,
        rank: int = 0,
        state_dict_options: StateDictOptions | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.lr_scheduler = lr_scheduler
        self.extras = dict(extras or {})
        self.step = step
        self.rank = rank
        self._options = state_dict_options

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options)
        key = f"rank_{self.rank}"
        sd: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "train": {"step": self.step},
            "rng": {key: rng_state()},
        }
        if self.loader is not None:
            sd["loader"] = {key: self.loader.state_dict()}
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.extras:
            sd["extras"] = {name: obj.state_dict() for name, obj in self.extras.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"rank_{self.rank}"
        try:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"],
                options=self._options,
            )
            self.step = int(state_dict["train"]["step"])
            if self.loader is not None:
                self.loader.load_state_dict(state_dict["loader"][key])
            if self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
            for name, obj in self.extras.items():
                obj.load_state_dict(state_dict["extras"][name])
            set_rng_state(state_dict["rng"][key])
        except KeyError as e:
            raise ItoError(
                ErrorCode.checkpoint_corrupt, f"checkpoint lacks training state entry {e}"
            ) from e
