"""A data-prep run SIGKILLed in the middle resumes from its finished stages and blocks
and completes with the same output as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.data_prep.cli import main as cli_main
from stages.data_prep.synth import planted_pair_corpus

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120
KILL_POLL_S = 0.005

pytestmark = pytest.mark.slow


def _cmd(src: Path, out: Path) -> list[str]:
    return ["dedup", "--input", str(src), "--output", str(out), "--block-docs", "60", "--json"]


def test_sigkill_midway_then_resume_gives_the_same_output(tmp_path: Path) -> None:
    texts, _ = planted_pair_corpus(2400, 800, seed=3)
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"n": i, "text": t}) + "\n" for i, t in enumerate(texts)),
        encoding="utf-8",
    )
    assert cli_main(_cmd(src, tmp_path / "reference")) == 0

    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.data_prep", *_cmd(src, out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # Kill it once the first three stages are finished and the fourth is under way.
    deadline = time.time() + RUN_TIMEOUT_S
    killed_in = None
    while time.time() < deadline and proc.poll() is None:
        fetch = list(tmp_path.glob("out.work/*/done/fetch/*.json"))
        if len(fetch) >= 3:
            proc.send_signal(signal.SIGKILL)
            killed_in = len(fetch)
            break
        time.sleep(KILL_POLL_S)
    proc.communicate(timeout=RUN_TIMEOUT_S)
    assert killed_in is not None and proc.returncode == -signal.SIGKILL
    assert not out.exists()  # nothing published by the killed attempt
    work = next(tmp_path.glob("out.work/*"))
    assert (work / "done" / "candidates.json").exists()
    assert not (work / "done" / "fetch.json").exists()

    proc = subprocess.run(
        [sys.executable, "-m", "stages.data_prep", *_cmd(src, out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    blocks = summary["blocks"]
    # sketch (every block), exact and candidates (every partition) and the fetch tasks
    # that finished before the kill were not run again.
    assert blocks == -(-len(texts) // 60) and summary["resumed_tasks"] >= blocks + 2 * 2 + killed_in
    ref = json.loads((tmp_path / "reference" / "manifest.json").read_text())
    got = json.loads((out / "manifest.json").read_text())
    assert got == ref
    for shard in got["shards"]:
        assert (out / shard["path"]).read_bytes() == (
            tmp_path / "reference" / shard["path"]
        ).read_bytes()
    assert not list(out.glob("*.tmp")) and not (tmp_path / "out.work").exists()
