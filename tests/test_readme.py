"""The README starts with the two commands and lists every error code."""

from __future__ import annotations

from pathlib import Path

from stages.errors import ErrorCode

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_two_commands_that_ci_runs() -> None:
    lines = [li for li in README.read_text().splitlines() if li.strip()]
    assert lines[1] == "```bash"
    assert lines[2].startswith("bash scripts/demo.sh")
    assert lines[3].startswith("bash scripts/test.sh")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def test_readme_lists_every_error_code() -> None:
    text = README.read_text()
    missing = [c.value for c in ErrorCode if f"| `{c.value}` |" not in text]
    assert not missing, f"README lacks: {missing}"
