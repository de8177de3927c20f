"""Streaming data prep: block-by-block dedup, decontamination and filtering that run in
one process or on Ray Data with the same code and the same result (see
docs/data_prep.md, "At corpus scale").

Names load on first use (``stages.data_prep.config`` imports ``stream.config`` while
the engine imports the data-prep config).
"""

import importlib
from typing import TYPE_CHECKING, Any

from stages.data_prep.stream.config import StreamConfig

if TYPE_CHECKING:
    from stages.data_prep.stream.blocks import BlockIndex, index_blocks, input_files
    from stages.data_prep.stream.executor import Executor, LocalExecutor, RayDataExecutor
    from stages.data_prep.stream.run import Progress, StreamResult, run_stream

_LAZY = {
    "BlockIndex": "blocks",
    "index_blocks": "blocks",
    "input_files": "blocks",
    "Executor": "executor",
    "LocalExecutor": "executor",
    "RayDataExecutor": "executor",
    "Progress": "run",
    "StreamResult": "run",
    "run_stream": "run",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"stages.data_prep.stream.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockIndex",
    "Executor",
    "LocalExecutor",
    "Progress",
    "RayDataExecutor",
    "StreamConfig",
    "StreamResult",
    "index_blocks",
    "input_files",
    "run_stream",
]
