"""The `ito` CLI against a real server subprocess: the whole tenant flow, one envelope
per --json invocation, readable output, exit codes, and no secret in any output."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from client_world import World
from helpers.manifests import example_manifest, write_manifest

from orchestrator.client.cli import (
    EXIT_AUTH,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_RUN_UNSUCCESSFUL,
    EXIT_SERVER_ERROR,
    EXIT_TRANSPORT,
    EXIT_USAGE,
)
from orchestrator.client.envelope import is_envelope
from stages.errors import ErrorCode

pytestmark = pytest.mark.slow  # a real server subprocess per module


def _one_envelope(out: str) -> dict:
    lines = out.splitlines()
    assert len(lines) == 1, out
    env = json.loads(lines[0])
    assert is_envelope(env), env
    return env


def test_full_flow(world: World, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    m, b = str(world.manifest), world.booking
    cli = world.cli

    def j(argv: list[str], **kw: str) -> tuple[int, dict]:
        status, env = cli(monkeypatch, [*argv, "--json"], **kw)
        assert _one_envelope(capsys.readouterr().out) == env
        return status, env

    status, env = j(["plan", "--booking", b, "--manifest", m])
    assert status == EXIT_OK and env["data"]["manifest_digest"]
    assert world.runs_for_booking() == []  # plan creates nothing

    ref = world.confirm_train(monkeypatch)
    capsys.readouterr()
    argv = [
        "train",
        "--booking",
        b,
        "--manifest",
        m,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        "flow-key-0001",
    ]
    status, env = j(argv)
    assert status == EXIT_OK and env["data"]["replayed"] is False
    run_id = env["data"]["run_id"]
    status, env = j(argv)  # the same request again: the same run
    assert status == EXIT_OK and env["data"]["replayed"] is True
    assert env["data"]["run_id"] == run_id
    assert world.runs_for_booking() == [(run_id, "flow-key-0001")]
    status, env = j(["find", "--idempotency-key", "flow-key-0001"])
    assert status == EXIT_OK and [r["run_id"] for r in env["data"]["runs"]] == [run_id]
    status, env = j(["find", "--idempotency-key", "never-used-key"])
    assert status == EXIT_OK and env["data"]["runs"] == []
    status, env = j(["eligibility", "--booking", b])
    assert status == EXIT_OK and env["data"]["eligible"] is True

    for cmd in (["status"], ["logs"], ["metrics"], ["checkpoints"]):
        status, env = j([*cmd, "--run", run_id])
        assert status == EXIT_OK, env
    status, env = j(["logs", "--run", run_id])
    assert any("accepted" in e["message"] for e in env["data"]["entries"])

    # The submitter cannot confirm (identity is not authority).
    status, env = j(["confirm", "--action", "cancel", "--booking", b, "--run", run_id])
    assert (status, env["error"]["code"]) == (EXIT_SERVER_ERROR, ErrorCode.forbidden_scope)

    status, env = j(
        ["confirm", "--action", "cancel", "--booking", b, "--run", run_id],
        key=world.tenant.approver,
    )
    cancel_ref = env["data"]["confirmation_ref"]
    status, env = j(
        [
            "cancel",
            "--run",
            run_id,
            "--confirmation-ref",
            cancel_ref,
            "--idempotency-key",
            "cancel-key-01",
        ]
    )
    assert status == EXIT_OK and env["data"]["state"] in ("cancelling", "cancelled")

    status, env = j(["status", "--run", run_id, "--follow", "--poll-interval", "0.1"])
    assert status == EXIT_RUN_UNSUCCESSFUL and env["data"]["state"] == "cancelled"
    status, env = j(["logs", "--run", run_id, "--follow", "--poll-interval", "0.1"])
    assert status == EXIT_OK and env["data"]["state"] == "cancelled"
    assert len(env["data"]["entries"]) >= 1

    # Proposals: the commands reach their routes; this run has none to decide.
    status, env = j(
        ["confirm", "--action", "restart", "--booking", b, "--run", run_id, "--proposal", "p_x"],
        key=world.tenant.approver,
    )
    assert (status, env["error"]["code"]) == (EXIT_SERVER_ERROR, ErrorCode.proposal_not_found)
    for decision in ("approve", "decline"):
        status, env = j(
            [
                decision,
                "--run",
                run_id,
                "--proposal",
                "p_x",
                "--confirmation-ref",
                "itoc_none",
                "--idempotency-key",
                f"{decision}-key-01",
            ]
        )
        assert status == EXIT_SERVER_ERROR and env["live_api_contacted"] is True
        assert env["error"]["code"] == ErrorCode.proposal_not_found

    status, env = j(
        ["confirm", "--action", "cleanup", "--booking", b, "--run", run_id],
        key=world.tenant.approver,
    )
    booking_before = world.booking_row()
    status, env = j(
        [
            "cleanup",
            "--run",
            run_id,
            "--confirmation-ref",
            env["data"]["confirmation_ref"],
            "--idempotency-key",
            "cleanup-key-1",
        ]
    )
    assert status == EXIT_OK and env["data"]["run"]["state"] == "cleaned"
    assert world.booking_row() == booking_before  # cleanup never changes the booking

    status, env = j(["confirm", "--action", "release", "--booking", b], key=world.tenant.approver)
    status, env = j(
        [
            "release",
            "--booking",
            b,
            "--confirmation-ref",
            env["data"]["confirmation_ref"],
            "--idempotency-key",
            "release-key-1",
        ]
    )
    assert status == EXIT_OK and env["data"]["state"] == "released"


def test_confirm_train_defaults_to_the_server_estimate(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    argv = ["--booking", world.booking, "--manifest", str(world.manifest), "--json"]
    _, plan = world.cli(monkeypatch, ["plan", *argv])
    _, conf = world.cli(
        monkeypatch, ["confirm", "--action", "train", *argv], key=world.tenant.approver
    )
    assert conf["data"]["cost_usd"] == pytest.approx(plan["data"]["cost_estimate_usd"])
    _, conf = world.cli(
        monkeypatch,
        ["confirm", "--action", "train", *argv, "--cost-usd", "3.5"],
        key=world.tenant.approver,
    )
    assert conf["data"]["cost_usd"] == pytest.approx(3.5)
    capsys.readouterr()


def test_swapped_after_confirmation_is_refused_and_no_run_exists(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    ref = world.confirm_train(monkeypatch)
    # Replace the vetted file (new inode, same safe properties) with other content.
    other = example_manifest(
        world.tmp / "ckpt", budget={"ceiling_usd": 4.0, "max_incremental_cost_usd": 1.0}
    )
    swap = write_manifest(world.tmp / "swap.json", other)
    os.replace(swap, world.manifest)
    argv = world.train_argv(ref, "swap-key-0001", "--json")
    status, env = world.cli(monkeypatch, argv)
    assert status == EXIT_SERVER_ERROR and env["live_api_contacted"] is True
    assert env["error"]["code"] in (
        ErrorCode.confirmation_digest_mismatch,
        ErrorCode.manifest_digest_mismatch,
    )
    assert world.runs_for_booking() == []
    _, found = world.cli(monkeypatch, ["status", "--run", "nope", "--json"])
    assert found["error"]["code"] == ErrorCode.run_not_found
    capsys.readouterr()


def test_readable_output(world: World, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    ref = world.confirm_train(monkeypatch)
    capsys.readouterr()
    status, _ = world.cli(
        monkeypatch,
        [
            "confirm",
            "--action",
            "train",
            "--booking",
            world.booking,
            "--manifest",
            str(world.manifest),
        ],
        key=world.tenant.approver,
    )
    out = capsys.readouterr()
    assert status == EXIT_OK and out.out.strip().startswith("itoc_")  # only the reference
    assert len(out.out.strip().splitlines()) == 1
    status, _ = world.cli(
        monkeypatch,
        world.train_argv(ref, "readable-key-01"),
    )
    out = capsys.readouterr()
    assert status == EXIT_OK and "state=accepted" in out.out and not out.out.startswith("{")
    status, _ = world.cli(monkeypatch, ["status", "--run", "run_missing"])
    out = capsys.readouterr()
    assert status == EXIT_SERVER_ERROR and out.out == ""
    assert "error [run_not_found] (server)" in out.err


@pytest.mark.parametrize(
    ("argv", "expect_status", "expect_code"),
    [
        (["train", "--json"], EXIT_USAGE, ErrorCode.bad_request),
        (["--json"], EXIT_USAGE, ErrorCode.bad_request),
        (["frobnicate", "--json"], EXIT_USAGE, ErrorCode.bad_request),
        (
            ["status", "--run", "r", "--json", "--api-url", "http://127.0.0.1:9"],
            EXIT_TRANSPORT,
            ErrorCode.api_unreachable,
        ),
        (
            ["plan", "--booking", "b", "--manifest", "rel.json", "--json"],
            EXIT_REFUSED,
            ErrorCode.manifest_path_not_absolute,
        ),
        (
            ["status", "--run", "r", "--json", "--api-url", "http://10.0.0.1:9"],
            EXIT_REFUSED,
            ErrorCode.bad_request,
        ),
        (["status", "--run", "run_nope", "--json"], EXIT_SERVER_ERROR, ErrorCode.run_not_found),
    ],
)
def test_json_prints_exactly_one_envelope_in_a_real_process(
    world: World, argv: list[str], expect_status: int, expect_code: str
) -> None:
    env_vars = {
        **os.environ,
        "ITO_API_KEY": world.tenant.submitter,
        "ITO_API_URL": world.backend.url,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.client.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_vars,
        stdin=subprocess.DEVNULL,
    )
    env = _one_envelope(proc.stdout)
    assert proc.returncode == expect_status, (proc.stdout, proc.stderr)
    assert env["error"]["code"] == expect_code
    assert proc.stderr == ""


def test_canary_secrets_appear_in_no_output(
    world: World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    canary = "CANARY-7f3c9a-do-not-print"
    bogus_key = f"itok_bogus0001_{canary}"
    secret_manifest = example_manifest(world.tmp / "ckpt")
    secret_manifest["data"]["refs"][0]["uri"] = f"https://user:{canary}@example.com/d.jsonl"
    leaky = write_manifest(tmp_path / "leaky.json", secret_manifest)
    base = {
        **os.environ,
        "ITO_API_URL": world.backend.url,
        "AWS_SECRET_ACCESS_KEY": canary,
        "HF_TOKEN": canary,
    }
    keys = {"submitter": world.tenant.submitter, "approver": world.tenant.approver}
    sub, appr = {"ITO_API_KEY": keys["submitter"]}, {"ITO_API_KEY": keys["approver"]}
    bogus = {"ITO_API_KEY": bogus_key}
    plan_leaky = ["plan", "--booking", world.booking, "--manifest", str(leaky)]
    confirm = [
        "confirm",
        "--action",
        "train",
        "--booking",
        world.booking,
        "--manifest",
        str(world.manifest),
    ]
    runs: list[tuple[dict[str, str], list[str]]] = [
        (sub, [*plan_leaky, "--json"]),
        (sub, plan_leaky),
        (appr, [*confirm, "--json"]),
        (appr, confirm),
        (sub, ["status", "--run", "run_x", "--json"]),
        (bogus, ["status", "--run", "run_x", "--json"]),
        (bogus, ["status", "--run", "run_x"]),
        (bogus, ["logs", "--run", "run_x", "--follow", "--json"]),
    ]
    outputs = []
    for extra, argv in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator.client.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**base, **extra},
            stdin=subprocess.DEVNULL,
        )
        outputs.append((argv, proc.returncode, proc.stdout + proc.stderr))
    for argv, _, text in outputs:
        assert canary not in text, argv
        for key in keys.values():
            # itok_<key_id>_<secret>: the secret itself may hold "_".
            secret = key.split("_", 2)[2]
            assert key not in text and secret not in text, argv
    # The runs did exercise the paths we care about.
    codes = [rc for _, rc, _ in outputs]
    assert EXIT_AUTH in codes and EXIT_OK in codes and EXIT_SERVER_ERROR in codes
    assert any("manifest_contains_secret" in t for _, _, t in outputs)


def test_readme_approver_key_confirms_as_written(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The approver key exactly as the README issues it (confirm:* scopes only) can run
    `ito confirm --action train`, which asks the server for the plan and cost first."""
    from helpers.tenants import admin

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "keys issue" in x and "# approver" in x)
    argv = shlex.split(line.split("#")[0])[1:]  # without "ito-backend"
    argv = [world.tenant.account if a == "acme" else a for a in argv if a != "--json"]
    issued = admin(world.backend.db, *argv)
    key = issued["data"]["api_key"]
    assert not any(s.startswith("runs:") for s in issued["data"]["scopes"])
    status, env = world.cli(
        monkeypatch,
        [
            "confirm",
            "--action",
            "train",
            "--booking",
            world.booking,
            "--manifest",
            str(world.manifest),
            "--json",
        ],
        key=key,
    )
    assert status == EXIT_OK, env
    assert env["data"]["confirmation_ref"]
    # Planning is allowed for review; reading runs is still the submitter's scope.
    status, env = world.cli(
        monkeypatch, ["find", "--idempotency-key", "any-key-0001", "--json"], key=key
    )
    assert status == EXIT_SERVER_ERROR and env["error"]["code"] == "forbidden_scope"
    capsys.readouterr()
