"""A signed launch ticket for tests that drive ``RunDriverImpl`` directly (the API
signs real ones): fixed booking and account, scratch under ``tmp_path``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from orchestrator.runtime import launch
from orchestrator.runtime.launch import LaunchSpec


def signed_spec(tmp_path: Path, run_id: str = "run_1", **fields: Any) -> LaunchSpec:
    spec = LaunchSpec(
        run_id=run_id,
        booking_id="bk_1",
        account="acme",
        manifest_digest="d" * 64,
        manifest_json="{}",
        accepted_at=time.time(),
        workdir=str(tmp_path / "w"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        **fields,
    )
    return launch.sign(spec)
