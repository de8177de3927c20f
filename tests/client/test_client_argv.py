"""No key in usage errors; an empty --manifest is refused locally."""

from __future__ import annotations

import json

import pytest

from orchestrator.client.cli import EXIT_REFUSED, EXIT_USAGE, redact_argv, run_cli

KEY = "itok_0123456789abcdef_S3cretS3cretS3cretS3cret"


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--booking", "b", "--manifest", "/m.json", "--api-key", KEY, "--json"],
        ["plan", "--booking", "b", "--manifest", "/m.json", f"--api-key={KEY}", "--json"],
        ["status", "--run", "r", "--token", "hunter2-hunter2", "--json"],
        ["status", KEY, "--json"],
        ["plan", "--api-key", KEY],  # human output too
    ],
)
def test_usage_errors_never_print_a_secret(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, env = run_cli(argv)
    out = capsys.readouterr()
    assert status == EXIT_USAGE and env["error"]["code"] == "bad_request"
    for secret in (KEY, "hunter2-hunter2"):
        assert secret not in out.out + out.err + json.dumps(env)


def test_redact_argv_keeps_ordinary_arguments() -> None:
    argv = ["train", "--booking", "bk-1", "--idempotency-key", "run-key-0001", "--json"]
    assert redact_argv(argv) == argv
    assert redact_argv(["--password", "x", "--api_key=y"]) == [
        "--password",
        "[redacted]",
        "--api_key=[redacted]",
    ]


@pytest.mark.parametrize("command", ["plan", "confirm", "train"])
def test_an_empty_manifest_path_is_a_local_refusal(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ITO_API_URL", "http://127.0.0.1:9")
    argv = {
        "plan": ["plan", "--booking", "b", "--manifest", ""],
        "confirm": ["confirm", "--action", "train", "--booking", "b", "--manifest", ""],
        "train": [
            "train",
            "--booking",
            "b",
            "--manifest",
            "",
            "--confirmation-ref",
            "c",
            "--idempotency-key",
            "key-00000001",
        ],
    }[command]
    status, env = run_cli([*argv, "--json"])
    assert status == EXIT_REFUSED, env
    assert env["live_api_contacted"] is False
    assert env["error"]["code"] == "manifest_path_not_absolute"
