"""The run's torchft lighthouse: torchft's Rust ``LighthouseServer``, hosted by a Ray
actor for the life of the run, behind a front.

The Rust server takes no credential and serves, on its gRPC port, an HTTP/1 dashboard
whose ``POST /replica/<id>/kill`` kills any replica group. So it binds ``127.0.0.1:P``
only, and a front (``stages.netfront``) on the node's cluster address, same port, is
what the ranks dial: it admits the run's own nodes only, and HTTP/2 only (gRPC), so
the dashboard and its kill route are unreachable from the network. SREs read the
quorum through the actor (``quorum_status``: the dashboard's read-only status,
fetched over loopback).

The lighthouse process needs only the Rust extension. ``import torchft`` (and so
``from torchft._torchft import ...``) first runs the package's ``__init__``, which
imports torch and the whole Manager stack: ~4 s of CPU before the server can bind,
and every trainer actor waits for the lighthouse's address. ``rust_extension`` loads
the extension module on its own; a process that later imports torchft reuses it.
"""

from __future__ import annotations

import html
import importlib.machinery
import importlib.util
import os
import re
import sys
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

from stages.netfront import LOOPBACK, Served, run_node_addresses, serve_behind_front
from stages.netsec import cluster_address, listener_config
from stages.run_facts import PlacementFact
from stages.trainer.config import FaultToleranceConfig

EXTENSION = "torchft._torchft"


def lighthouse_name(run_id: str) -> str:
    return f"run-{run_id}-lighthouse"


# How often a rank made before its run's lighthouse looks the lighthouse up by name.
LOOKUP_INTERVAL_S = 0.05


def lighthouse_address(run_id: str, timeout_s: float) -> str:
    """The address of run ``run_id``'s lighthouse, for a rank made before it (the engine
    makes the ranks first): its name may not be registered yet, so it is looked up
    until ``timeout_s``."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(lighthouse_name(run_id))
            break
        except ValueError:  # not registered yet
            if time.monotonic() > deadline:
                raise
            time.sleep(LOOKUP_INTERVAL_S)
    return str(ray.get(actor.address.remote(), timeout=max(0.0, deadline - time.monotonic())))


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
    cfg: FaultToleranceConfig, *, min_replicas: int = 1, bind: str = f"{LOOPBACK}:0"
) -> Any:
    """torchft's own Rust lighthouse server, in this process, on ``bind`` (a run's
    lighthouse binds loopback only; its front publishes it)."""
    return rust_extension().LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=cfg.join_timeout_ms,
        quorum_tick_ms=cfg.quorum_tick_ms,
        heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
    )


def serve_lighthouse(
    cfg: FaultToleranceConfig,
    *,
    min_replicas: int = 1,
    placement: PlacementFact | None = None,
) -> Served[Any]:
    """The lighthouse on ``127.0.0.1:P`` and its front on this node's cluster address,
    port ``P`` from the deployment's range, admitting the nodes of the run's placement
    (every Ray node when it has none)."""
    return serve_behind_front(
        cluster_address(),
        listener_config(),
        lambda port: start_lighthouse(cfg, min_replicas=min_replicas, bind=f"{LOOPBACK}:{port}"),
        allowed=lambda: run_node_addresses(placement),
        cfg=cfg.front,
        http2_only=True,
        name="lighthouse",
    )


_TAG = re.compile(r"<[^>]*>")


def status_text(page: str) -> str:
    """The dashboard's status fragment as plain lines."""
    lines = (html.unescape(line).strip() for line in _TAG.sub("\n", page).splitlines())
    return "\n".join(line for line in lines if line)


class LighthouseActor:
    """torchft's Rust LighthouseServer and its front, kept alive for the run."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        min_replicas: int = 1,
        placement: PlacementFact | None = None,
    ):
        os.environ.setdefault("RUST_LOG", "warn")
        self.cfg = cfg
        self.served = serve_lighthouse(cfg, min_replicas=min_replicas, placement=placement)
        self.server = self.served.backend

    def address(self) -> str:
        """What the ranks dial: the front on the cluster address."""
        return f"http://{self.served.address}"

    def quorum_status(self) -> str:
        """The quorum as the lighthouse's dashboard shows it (read-only, over loopback):
        the current quorum id, the next quorum's state, the members and heartbeats."""
        url = f"http://{LOOPBACK}:{self.served.port}/status"
        with urllib.request.urlopen(url, timeout=self.cfg.lighthouse_status_timeout_s) as r:
            return status_text(
                r.read(self.cfg.lighthouse_status_max_bytes).decode(errors="replace")
            )

    def front_stats(self) -> dict[str, int]:
        """Connections the front admitted and refused, by reason ({} with no front)."""
        return self.served.front.stats() if self.served.front is not None else {}

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.served.close()
        self.server.shutdown()
