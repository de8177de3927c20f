"""``ito-backend serve --runtime ray`` (which starts its own embedded Ray head) with a
tenant on a CPU-testbed booking and two small corpora: the server the end-to-end Ray
tests submit runs to. One per test module (``ray_backend(...)`` in a module fixture)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers.backend import Backend, free_port
from helpers.ray_local import note_start, start_turn
from helpers.tenants import cpu_booking_doc, make_tenant
from orchestrator.runtime import ray_cluster

REPO = Path(__file__).resolve().parents[2]
# The first start also starts the Ray head (and imports torch in the driver).
RAY_BACKEND_STARTUP_TIMEOUT_S = 240.0
RAY_NUM_CPUS = 4


def write_docs(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def python_docs_corpus(path: Path, docs: int) -> Path:
    """The first ``docs`` documents of the repo's python docs as a training file at
    ``path`` (its folder made): the corpus the end-to-end runs train on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (REPO / "data" / "python_docs" / "train.jsonl").read_text().splitlines()[:docs]
    return write_docs(path, [json.loads(li)["text"] for li in lines])


def corpora(folder: Path, baseline_docs: int, custom_docs: int) -> tuple[Path, Path]:
    """A baseline (the repo's python docs) and a custom (GSM8K Q&A) training file."""
    baseline = python_docs_corpus(folder / "baseline.jsonl", baseline_docs)
    gsm = [
        json.loads(li)
        for li in (REPO / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:custom_docs]
    ]
    custom = write_docs(folder / "custom.jsonl", [f"{g['question']}\n{g['answer']}" for g in gsm])
    return baseline, custom


@contextmanager
def ray_backend(
    tmp: Path,
    booking_id: str,
    *,
    gpus_per_node: int = 2,
    planner_gate: bool = True,
    env: dict[str, str] | None = None,
    db: str | None = None,
) -> Iterator[dict[str, Any]]:
    """A started Ray-backed server; yields ``{"backend", "tenant", "tmp", "dashboard"}``
    and stops the server and its embedded head at the end. ``db``: the store (a
    PostgreSQL URL); a SQLite file in ``tmp`` by default."""
    dash = free_port()
    be = Backend(
        db=db or tmp / "ito.db",
        var_dir=tmp / "var",
        log_path=tmp / "backend.log",
        extra_args=[
            "--runtime",
            "ray",
            *(["--planner-gate"] if planner_gate else []),
            "--ray-head-port",
            str(free_port()),
            "--ray-dashboard-port",
            str(dash),
            # Every port of the head its own: heads of tests on other workers run beside it.
            "--ray-client-server-port",
            str(free_port()),
            "--ray-dashboard-agent-port",
            str(free_port()),
            "--ray-num-cpus",
            str(RAY_NUM_CPUS),
        ],
        env=dict(env or {}),
        startup_timeout_s=RAY_BACKEND_STARTUP_TIMEOUT_S,
    )
    tenant = make_tenant(
        be.db, "acme", booking=cpu_booking_doc(booking_id, "acme", gpus=gpus_per_node)
    )
    try:
        with start_turn():  # its embedded head starts with it
            be.start()
        note_start("embedded-head", str(tmp))
        yield {"backend": be, "tenant": tenant, "tmp": tmp, "dashboard": dash}
    finally:
        be.stop()
        ray_cluster.stop_local_head(be.var_dir)
