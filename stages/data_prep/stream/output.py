"""Where a streaming run's executor comes from, and single-file outputs.

``--ray-address``: none runs every task in this process; ``local`` starts a Ray of
this machine for the run (object store of ``object_store_memory_mb``, spilling to
``spill_dir`` when full) and stops it afterwards; ``auto`` or ``HOST:PORT`` joins a
running cluster, whose spilling is configured where it was started
(``ray start --system-config``, see docs/data_prep.md). Inside a run's Ray driver Ray
is already up and is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stages.atomic_write import open_atomic
from stages.data_prep.stream.config import StreamConfig
from stages.data_prep.stream.executor import Executor, LocalExecutor, RayDataExecutor
from stages.errors import ErrorCode, ItoError

_COPY_CHUNK = 1 << 20


def spilling_config(directory: str) -> str:
    """Ray's ``object_spilling_config`` for spilling to a local folder."""
    return json.dumps({"type": "filesystem", "params": {"directory_path": directory}})


@contextmanager
def executor_for(address: str | None, cfg: StreamConfig) -> Iterator[Executor]:
    if address is None:
        yield LocalExecutor()
        return
    import ray

    if ray.is_initialized():
        yield RayDataExecutor(cfg)
        return
    temp = None
    try:
        if address == "local":
            # A short folder of our own: Ray's socket paths must stay under 107 bytes.
            temp = tempfile.mkdtemp(prefix="itodp")
            spill = cfg.spill_dir or os.path.join(temp, "spill")
            ray.init(
                address="local",
                num_cpus=os.cpu_count() or 1,
                include_dashboard=False,
                object_store_memory=cfg.object_store_memory_mb * 1024 * 1024,
                _temp_dir=temp,
                log_to_driver=False,
                _system_config={"object_spilling_config": spilling_config(spill)},
            )
        else:
            ray.init(address=address, log_to_driver=False)
    except ItoError:
        raise
    except Exception as e:  # ConnectionError, RuntimeError, ValueError from ray.init
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
        raise ItoError(
            ErrorCode.ray_unavailable, f"cannot reach Ray at {address}: {type(e).__name__}"
        ) from e
    try:
        yield RayDataExecutor(cfg)
    finally:
        ray.shutdown()
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def concat_shards(folder: Path, shards: list[str], dest: Path, fmt: str) -> tuple[str, int]:
    """Join the shards of ``folder`` (in order) into one file ``dest`` atomically,
    streaming (a row group of parquet or 1 MiB of jsonl at a time); (sha256, bytes)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with open_atomic(dest) as out:
            for name in shards:
                with open(folder / name, "rb") as f:
                    shutil.copyfileobj(f, out, _COPY_CHUNK)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schemas = [pq.read_schema(folder / n) for n in shards]
        nonempty = [
            s
            for s, n in zip(schemas, shards, strict=True)
            if pq.ParquetFile(folder / n).metadata.num_rows
        ]
        try:
            schema = pa.unify_schemas(nonempty or schemas[:1])
        except pa.ArrowInvalid as e:
            raise ItoError(
                ErrorCode.data_format_unsupported,
                "the records' fields differ between blocks; write a folder of "
                "shards (an --output without a .parquet suffix)",
            ) from e
        with open_atomic(dest) as out, pq.ParquetWriter(out, schema) as writer:
            for name in shards:
                pf = pq.ParquetFile(folder / name)
                for g in range(pf.num_row_groups):
                    t = pf.read_row_group(g)
                    if t.num_rows:
                        writer.write_table(t.cast(schema) if t.schema != schema else t)
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest(), dest.stat().st_size
