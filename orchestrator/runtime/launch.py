"""What the supervisor hands a RunDriver, and the ticket that proves it came from
the API server.

No workload may start without an accepted run in the store. The supervisor signs
each launch (HMAC-SHA256 over the run, booking, manifest digest, attempt and
expiry) with a launch key that only the backend's deployment can read; the driver
verifies the ticket before it runs anything, so an actor created some other way
(Ray Jobs, the dashboard, a stray script) refuses to run. The key lives in a file
(``ITO_LAUNCH_KEY_FILE``, default ``~/.ito/launch.key``, mode 0600): the embedded
default and the Slurm deploy share it through the file system, KubeRay mounts it
from a Secret. Whoever can read that file can launch; keep it with the API key DB.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.errors import ErrorCode, ItoError
from stages.keys import LAUNCH_KEY_ENV as LAUNCH_KEY_ENV  # re-exported
from stages.keys import launch_key_path, read_launch_key
from stages.run_facts import RunFacts

# A ticket is only good for starting a driver soon after it was signed.
LAUNCH_TICKET_TTL_S = 300.0


def ensure_launch_key(path: Path | None = None) -> Path:
    """Create the launch key (32 random bytes, 0600) if it does not exist."""
    path = path or launch_key_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def use_scratch_launch_key(folder: Path) -> Path:
    """For a process that runs the engine with no server (a benchmark run by hand): the
    launch key named by the environment, else a throwaway one made in ``folder`` and
    named there (the engine signs its checkpoints with it; Ray's workers inherit it)."""
    if LAUNCH_KEY_ENV not in os.environ:
        os.environ[LAUNCH_KEY_ENV] = str(ensure_launch_key(folder / "launch.key"))
    return Path(os.environ[LAUNCH_KEY_ENV])


def _read_key(path: Path | None = None) -> bytes:
    return read_launch_key(ErrorCode.driver_not_authorized, path)


class LaunchSpec(BaseModel):
    """Everything a RunDriver needs; contains no secret (the ticket is a MAC)."""

    model_config = ConfigDict(extra="forbid")
    run_id: str
    booking_id: str
    account: str
    manifest_digest: str
    manifest_json: str
    accepted_at: float
    workdir: str
    checkpoint_dir: str
    # What the orchestrator resolved for the run (stages.run_facts), validated here
    # once; its ``account`` is always the signed ``account`` above (the MAC covers that
    # field, not the facts).
    facts: RunFacts = Field(default_factory=RunFacts)
    # Stages that already finished in an earlier driver of this run (relaunch).
    completed_stages: dict[str, dict[str, Any]] = Field(default_factory=dict)
    seq_start: int = 1
    attempt: int = 1
    expires_at: float = 0.0
    ticket: str = ""

    @model_validator(mode="after")
    def _signed_account_in_facts(self) -> LaunchSpec:
        if self.facts.account != self.account:
            self.facts = self.facts.model_copy(update={"account": self.account})
        return self

    def _message(self) -> bytes:
        parts = [
            self.run_id,
            self.booking_id,
            self.account,
            self.manifest_digest,
            hashlib.sha256(self.manifest_json.encode()).hexdigest(),
            self.checkpoint_dir,
            str(self.attempt),
            f"{self.expires_at:.3f}",
        ]
        return "\x1f".join(parts).encode()


def sign(spec: LaunchSpec, *, key_path: Path | None = None) -> LaunchSpec:
    expires = time.time() + LAUNCH_TICKET_TTL_S
    unsigned = spec.model_copy(update={"expires_at": expires, "ticket": ""})
    mac = hmac.new(_read_key(key_path), unsigned._message(), hashlib.sha256).hexdigest()
    return unsigned.model_copy(update={"ticket": mac})


def verify(spec: LaunchSpec, *, key_path: Path | None = None) -> None:
    """Raise ``driver_not_authorized`` unless the ticket is valid and fresh."""
    if not spec.ticket:
        raise ItoError(
            ErrorCode.driver_not_authorized,
            "no launch ticket: runs start only through the canonical API",
        )
    expected = hmac.new(_read_key(key_path), spec._message(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, spec.ticket):
        raise ItoError(ErrorCode.driver_not_authorized, "launch ticket does not verify")
    if time.time() > spec.expires_at:
        raise ItoError(ErrorCode.driver_not_authorized, "launch ticket expired")
