"""The run's torchft lighthouse: torchft's Rust ``LighthouseServer``, hosted by a Ray
actor for the life of the run.

The lighthouse process needs only the Rust extension. ``import torchft`` (and so
``from torchft._torchft import ...``) first runs the package's ``__init__``, which
imports torch and the whole Manager stack: ~4 s of CPU before the server can bind,
and every trainer actor waits for the lighthouse's address. ``rust_extension`` loads
the extension module on its own; a process that later imports torchft reuses it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from stages.trainer.config import FaultToleranceConfig

EXTENSION = "torchft._torchft"


def lighthouse_name(run_id: str) -> str:
    return f"run-{run_id}-lighthouse"


def rust_extension() -> ModuleType:
    """torchft's compiled module, without importing the torchft package."""
    if EXTENSION in sys.modules:
        return sys.modules[EXTENSION]
    pkg = importlib.util.find_spec("torchft")  # locates the package, runs nothing
    folders = list(pkg.submodule_search_locations or []) if pkg is not None else []
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for path in (Path(d) / f"_torchft{s}" for d in folders for s in suffixes):
        if path.is_file():
            loader = importlib.machinery.ExtensionFileLoader(EXTENSION, str(path))
            spec = importlib.util.spec_from_file_location(EXTENSION, path, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            sys.modules[EXTENSION] = module
            return module
    return importlib.import_module(EXTENSION)  # an unusual install: the ordinary import


def start_lighthouse(
    cfg: FaultToleranceConfig, *, min_replicas: int = 1, bind: str = "[::]:0"
) -> Any:
    """torchft's own Rust lighthouse server, in this process."""
    return rust_extension().LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=cfg.join_timeout_ms,
        quorum_tick_ms=cfg.quorum_tick_ms,
        heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
    )


class LighthouseActor:
    """torchft's Rust LighthouseServer, kept alive for the run by this actor."""

    def __init__(self, cfg: FaultToleranceConfig, min_replicas: int = 1):
        os.environ.setdefault("RUST_LOG", "warn")
        self.server = start_lighthouse(cfg, min_replicas=min_replicas)

    def address(self) -> str:
        return str(self.server.address())

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.server.shutdown()
