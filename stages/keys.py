"""The deployment's launch key file: where it is and how it is read.

The API server signs drivers with it (``orchestrator/runtime/launch.py``) and every
node that runs a driver or a trainer can read it (the Slurm deploys share it on the
file system, KubeRay mounts it from a Secret); checkpoint seals derive their key
from it (``stages/checkpointing/seal.py``). Both sides import it from here.
"""

from __future__ import annotations

import os
from pathlib import Path

from stages.errors import ErrorCode, ItoError

LAUNCH_KEY_ENV = "ITO_LAUNCH_KEY_FILE"


def launch_key_path() -> Path:
    return Path(os.environ.get(LAUNCH_KEY_ENV) or Path.home() / ".ito" / "launch.key")


def read_launch_key(code: ErrorCode, path: Path | None = None) -> bytes:
    """The key's bytes; ``code`` when it is missing, unreadable or not private."""
    path = path or launch_key_path()
    try:
        st = path.stat()
        if st.st_mode & 0o077:
            raise ItoError(code, f"launch key {path} must not be readable by group or others")
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise ItoError(code, f"launch key unavailable: {e}") from e
