"""The switch that keeps CI from skipping what it is meant to cover: off CI a test
whose system tool is missing skips; where CI requires the tool
(``ITO_REQUIRE_<TOOL>=1``, set by scripts/test.sh) it fails instead."""

from __future__ import annotations

import shutil

import pytest
from helpers import tools

ABSENT = "ito-no-such-binary"


def test_a_missing_tool_skips_off_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ITO_REQUIRE_NOSUCH", raising=False)
    with pytest.raises(pytest.skip.Exception, match=ABSENT):
        tools.require("nosuch", ABSENT)


def test_a_missing_tool_fails_where_ci_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITO_REQUIRE_NOSUCH", "1")
    with pytest.raises(pytest.fail.Exception, match="required in CI"):
        tools.require("nosuch", "sh", ABSENT)


def test_a_present_tool_gives_its_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITO_REQUIRE_NOSUCH", "1")
    assert tools.require("nosuch", "sh") == {"sh": shutil.which("sh")}


def test_a_root_only_test_skips_off_ci_and_fails_where_ci_requires_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tools.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("ITO_REQUIRE_ROOT", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root: chown"):
        tools.require_root("chown to another uid")
    monkeypatch.setenv("ITO_REQUIRE_ROOT", "1")
    with pytest.raises(pytest.fail.Exception, match="required in CI"):
        tools.require_root("chown to another uid")
    monkeypatch.setattr(tools.os, "geteuid", lambda: 0)
    tools.require_root("chown to another uid")  # root: the test goes on
