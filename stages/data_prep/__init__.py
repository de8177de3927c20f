"""data_prep stage: data manifest and digests, MinHash dedup, decontamination, ladder probe.

Public entry points (see docs/data_prep.md):
``DataPrepStage(config).run(ctx)``; ``file_sha256``, ``folder_sha256`` (the digests a
manifest's DataRef carries); ``dedup.dedup``; ``EvalIndex`` + ``decontaminate``;
``load_eval_items``; ``ladder_probe``. CLI: ``python -m stages.data_prep``.
"""

import importlib
from typing import TYPE_CHECKING, Any

from stages.data_prep.config import (
    DataPrepConfig,
    DataProvenance,
    DataRef,
    DecontaminationConfig,
    DedupConfig,
    LadderProbeConfig,
)
from stages.data_prep.evals import (
    EvalItem,
    EvalSuite,
    list_eval_suites,
    load_eval_items,
    load_eval_suite,
)
from stages.data_prep.refs import file_sha256, folder_sha256, path_sha256, resolve_ref

if TYPE_CHECKING:
    from stages.data_prep.decontam import DecontamResult, EvalIndex, decontaminate
    from stages.data_prep.dedup import DedupResult
    from stages.data_prep.ladder import LadderResult, decide, ladder_probe
    from stages.data_prep.stage import DataPrepStage

# The probe and the stage import torch and transformers (seconds); Ray workers that
# only sketch documents import this package too, so those names load on first use.
# Dedup and decontamination (datasketch, scipy) too: the run driver imports the
# manifest's models (``config``) before it plans and starts the trainer fleet. (The
# ``dedup`` function is its module's: a package attribute would be shadowed by the
# submodule once imported.)
_LAZY = {
    "DecontamResult": "stages.data_prep.decontam",
    "EvalIndex": "stages.data_prep.decontam",
    "decontaminate": "stages.data_prep.decontam",
    "DedupResult": "stages.data_prep.dedup",
    "DataPrepStage": "stages.data_prep.stage",
    "LadderResult": "stages.data_prep.ladder",
    "decide": "stages.data_prep.ladder",
    "ladder_probe": "stages.data_prep.ladder",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DataPrepConfig",
    "DataPrepStage",
    "DataProvenance",
    "DataRef",
    "DecontamResult",
    "DecontaminationConfig",
    "DedupConfig",
    "DedupResult",
    "EvalIndex",
    "EvalItem",
    "EvalSuite",
    "LadderProbeConfig",
    "LadderResult",
    "decide",
    "decontaminate",
    "file_sha256",
    "folder_sha256",
    "ladder_probe",
    "list_eval_suites",
    "load_eval_items",
    "load_eval_suite",
    "path_sha256",
    "resolve_ref",
]
