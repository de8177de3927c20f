"""Settings of the streaming (block-by-block, Ray Data) data-prep engine."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from stages.base import StrictModel
from stages.pathfields import PathField


class StreamConfig(StrictModel):
    # Documents per input block: a task's memory is proportional to this (texts, the
    # (num_perm x shingles) matrix of a sketch batch), never to the corpus.
    block_docs: int = Field(default=20_000, ge=1, le=10_000_000)
    # LSH band rows (one per band per document) per bucket partition: the shuffle's
    # fan-out is ceil(docs x bands / rows_per_partition), at least min_partitions.
    rows_per_partition: int = Field(default=1_000_000, ge=1, le=10**9)
    min_partitions: int = Field(default=2, ge=1, le=4096)
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    # The stage runs its tasks on Ray Data when Ray is up (inside a run's driver) and
    # the inputs hold at least ``ray_min_bytes``; "local"/"ray" force either way.
    executor: Literal["auto", "local", "ray"] = "auto"
    ray_min_bytes: int = Field(default=256 * 2**20, ge=0, le=1 << 50)
    # Seconds between progress events of one step (a new step always reports).
    progress_interval_s: float = Field(default=5.0, ge=0, le=3600)
    # On resume, re-hash every finished task's outputs (else size only).
    verify_digests: bool = True
    # No task finished for this long: the stage fails (a hung worker, a lost node).
    stall_timeout_s: float = Field(default=1800.0, gt=0, le=86_400)
    # Ray Data: CPUs per task (a task lost with its worker is retried by Ray Data).
    task_cpus: float = Field(default=1.0, gt=0, le=256)
    # Only when this process starts its own local Ray (``ray_address="local"``): the
    # object store's size and where it spills to disk when full. A cluster started
    # by deploy/ sets these with ``ray start --object-store-memory`` and
    # ``--system-config '{"object_spilling_config": ...}'``.
    object_store_memory_mb: int = Field(default=1024, ge=78, le=1 << 20)
    spill_dir: Annotated[str | None, PathField("data", "dir", form="path")] = None
