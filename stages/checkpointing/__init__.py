"""Checkpointing stage: async DCP saves listed only once complete."""

from stages.checkpointing.checkpointer import SAVE_TIMEOUT_S, WRITER_THREADS, Checkpointer
from stages.checkpointing.config import CheckpointPolicy
from stages.checkpointing.storage import (
    COMMIT_NAME,
    CheckpointRecord,
    delete_checkpoint,
    list_checkpoints,
    read_record,
    storage_usage,
    sweep_incomplete,
)

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
