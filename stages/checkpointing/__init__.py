"""Checkpointing stage: async DCP saves listed only once complete."""

from typing import TYPE_CHECKING, Any

from stages.checkpointing.config import CheckpointPolicy
from stages.checkpointing.seal import COMMIT_NAME
from stages.checkpointing.storage import (
    CheckpointRecord,
    delete_checkpoint,
    list_checkpoints,
    read_record,
    storage_usage,
    sweep_incomplete,
)

if TYPE_CHECKING:
    from stages.checkpointing.checkpointer import SAVE_TIMEOUT_S, WRITER_THREADS, Checkpointer

_LAZY = ("SAVE_TIMEOUT_S", "WRITER_THREADS", "Checkpointer")


def __getattr__(name: str) -> Any:
    """The Checkpointer imports torch.distributed: load it only when asked for, so the
    API server (which only lists checkpoints) starts without torch."""
    if name in _LAZY:
        from stages.checkpointing import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)


__all__ = [
    "COMMIT_NAME",
    "SAVE_TIMEOUT_S",
    "WRITER_THREADS",
    "CheckpointPolicy",
    "CheckpointRecord",
    "Checkpointer",
    "delete_checkpoint",
    "list_checkpoints",
    "read_record",
    "storage_usage",
    "sweep_incomplete",
]
