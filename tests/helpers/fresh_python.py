"""Run code in a fresh interpreter at the repo root: what a new process imports (the
driver's, the lighthouse's) can only be seen in one that imported nothing yet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# A hang guard, never a speed claim; under pytest's 300 s default, so the callers need
# no timeout mark of their own.
FRESH_PYTHON_TIMEOUT_S = 240.0


def run_python(code: str, *, stdin: str | None = None) -> Any:
    """Run ``code``; returns the JSON its last stdout line prints (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=FRESH_PYTHON_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
