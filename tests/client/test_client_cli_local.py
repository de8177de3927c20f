"""CLI behaviour that needs no server: one envelope for help and usage errors, the
exit-status mapping, and a client bug still answered by an envelope."""

from __future__ import annotations

import json

import pytest

from orchestrator.client import cli
from orchestrator.client.cli import (
    EXIT_AUTH,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_SERVER_ERROR,
    EXIT_TRANSPORT,
    EXIT_USAGE,
    exit_code_for,
    run_cli,
)
from orchestrator.client.envelope import error_envelope, is_envelope, ok_envelope
from stages.errors import ErrorCode


def _stdout_envelope(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 1, out.out
    env = json.loads(lines[0])
    assert is_envelope(env)
    assert out.err == ""
    return env


@pytest.mark.parametrize("argv", [["--help", "--json"], ["train", "--json", "-h"]])
def test_help_under_json_is_one_envelope(argv: list[str], capsys) -> None:
    status, env = run_cli(argv)
    assert status == EXIT_OK and "usage: ito" in env["data"]["help"]
    assert _stdout_envelope(capsys) == env


@pytest.mark.parametrize(
    "argv",
    [
        ["--json"],
        ["train", "--json"],
        ["confirm", "--action", "bogus", "--booking", "b", "--json"],
        ["status", "--run", "r", "--poll-interval", "x", "--json"],
        ["logs", "--json", "--run"],
    ],
)
def test_usage_errors_are_one_envelope(argv: list[str], capsys) -> None:
    status, env = run_cli(argv)
    assert status == EXIT_USAGE and env["error"]["code"] == ErrorCode.bad_request
    assert env["live_api_contacted"] is False
    assert _stdout_envelope(capsys) == env


def test_client_bug_is_still_one_envelope(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("ITO_API_KEY", "itok_x_secretvalue")

    def boom(*_a: object, **_k: object) -> dict:
        raise RuntimeError("itok_x_secretvalue leaked?")

    monkeypatch.setattr(cli, "_dispatch", boom)
    status, env = run_cli(["status", "--run", "r", "--json", "--api-url", "http://127.0.0.1:9"])
    assert status == EXIT_INTERNAL and env["error"]["code"] == ErrorCode.internal_error
    assert "secretvalue" not in json.dumps(_stdout_envelope(capsys))


@pytest.mark.parametrize(
    ("env", "status"),
    [
        (ok_envelope({}), EXIT_OK),
        (error_envelope(ErrorCode.credential_revoked, "", live_api_contacted=True), EXIT_AUTH),
        (error_envelope(ErrorCode.unauthenticated, "", live_api_contacted=True), EXIT_AUTH),
        (error_envelope(ErrorCode.forbidden_scope, "", live_api_contacted=True), EXIT_SERVER_ERROR),
        (error_envelope(ErrorCode.run_not_found, "", live_api_contacted=True), EXIT_SERVER_ERROR),
        (error_envelope(ErrorCode.api_unreachable, ""), EXIT_TRANSPORT),
        (error_envelope(ErrorCode.api_timeout, ""), EXIT_TRANSPORT),
        (error_envelope(ErrorCode.ambiguous_transport_failure, ""), EXIT_TRANSPORT),
        (error_envelope(ErrorCode.manifest_symlink, ""), EXIT_REFUSED),
        (error_envelope(ErrorCode.credentials_file_insecure, ""), EXIT_REFUSED),
        (error_envelope(ErrorCode.internal_error, ""), EXIT_INTERNAL),
    ],
)
def test_exit_status_mapping(env: dict, status: int) -> None:
    assert exit_code_for(env) == status
