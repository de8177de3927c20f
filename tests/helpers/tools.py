"""System tools some tests drive for real (Slurm, kubectl, ss, Prometheus, PostgreSQL),
and root, which some tests need (a file owned by another uid, Slurm's daemons).

Off CI a missing tool skips its tests. In CI ``scripts/test.sh`` installs each tool and
sets ``ITO_REQUIRE_<TOOL>=1`` (``ITO_REQUIRE_ROOT=1`` always); there a missing tool, or
a runner that is not root, fails the test instead, so nothing that CI is meant to cover
skips silently."""

from __future__ import annotations

import glob
import os
import shutil

import pytest


def required(tool: str) -> bool:
    """Whether CI requires ``tool`` (``ITO_REQUIRE_<TOOL>=1``, set by scripts/test.sh)."""
    return os.environ.get(f"ITO_REQUIRE_{tool.upper()}") == "1"


def which(binary: str) -> str | None:
    """``binary`` on PATH, or under Debian's /usr/lib/postgresql/<major>/bin."""
    found = shutil.which(binary)
    if found is None:
        hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{binary}"))
        found = hits[-1] if hits else None
    return found


def missing(tool: str, reason: str, *, allow_module_level: bool = False) -> None:
    """Skip for ``reason``, or fail when CI requires ``tool``."""
    if required(tool):
        pytest.fail(
            f"{tool} is required in CI (ITO_REQUIRE_{tool.upper()}=1): {reason}", pytrace=False
        )
    pytest.skip(reason, allow_module_level=allow_module_level)


def require(tool: str, *binaries: str, allow_module_level: bool = False) -> dict[str, str]:
    """The paths of ``binaries``; skips (or fails in CI) when one is missing."""
    paths = {b: which(b) for b in binaries}
    absent = [b for b, p in paths.items() if p is None]
    if absent:
        missing(
            tool,
            f"needs {', '.join(absent)} (scripts/test.sh installs it in CI)",
            allow_module_level=allow_module_level,
        )
    return {b: p for b, p in paths.items() if p is not None}


def require_root(reason: str, *, allow_module_level: bool = False) -> None:
    """Go on as root; otherwise skip for ``reason``, or fail where CI requires root."""
    if os.geteuid() != 0:
        missing("root", f"needs root: {reason}", allow_module_level=allow_module_level)
