"""`ito manifest init` against a real server: the short form becomes a complete,
reviewable 0600 manifest with the server's plan and cost, and nothing is submitted;
the printed confirm and train commands then work on that file as written."""

from __future__ import annotations

import hashlib
import json
import shlex
import stat
from pathlib import Path

import pytest
from client_world import World
from helpers.tenants import booking_doc, make_tenant

from orchestrator.client.cli import EXIT_OK, EXIT_REFUSED
from stages.checkpointing.config import DEFAULT_INTERVAL_STEPS

pytestmark = pytest.mark.slow  # the session's real server subprocess


def _data(tmp: Path) -> Path:
    """One file for both uses of the short form's single ``--data``: pretraining reads
    ``text``, SFT reads ``messages`` (the server checks the conversational format)."""
    path = tmp / "data" / "train.jsonl"
    path.parent.mkdir()
    path.write_text(
        "".join(
            json.dumps(
                {
                    "text": f"problem {i}: 3 + {i} = {3 + i}",
                    "messages": [
                        {"role": "user", "content": f"3 + {i}?"},
                        {"role": "assistant", "content": str(3 + i)},
                    ],
                }
            )
            + "\n"
            for i in range(50)
        )
    )
    return path


def test_init_writes_a_complete_manifest_plans_it_and_submits_nothing(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = world.tmp / "review" / "m.json"
    out.parent.mkdir()
    data = _data(world.tmp)
    status, env = world.cli(
        monkeypatch,
        [
            "manifest",
            "init",
            "--booking",
            world.booking,
            "--model-size",
            "1B",
            "--data",
            str(data),
            "--target",
            "gsm8k",
            "--budget-usd",
            "500",
            "--post-training",
            "sft",
            "--output",
            str(out),
            "--json",
        ],
    )
    assert status == EXIT_OK, env
    d = env["data"]
    raw = out.read_bytes()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert d["manifest_digest"] == hashlib.sha256(raw).hexdigest() == d["server_digest"]
    assert isinstance(d["cost_estimate_usd"], float) and 0 < d["cost_estimate_usd"] <= 500
    assert world.runs_for_booking() == []  # never submits
    m = json.loads(raw)
    assert m["model"]["preset"] == "llama-1b" and m["model"]["size"] == "1B"
    assert m["data"]["refs"][0]["uri"] == f"file://{data}"
    assert m["data"]["refs"][0]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert m["data"]["eval_suites"] == ["gsm8k"]
    # The recipe and the defaults are spelled out, not left implicit.
    assert set(m["post_training"]) == {"sft"}
    assert m["post_training"]["sft"]["learning_rate"] == 2e-5
    assert m["checkpoint"]["interval_steps"] == DEFAULT_INTERVAL_STEPS
    assert m["checkpoint"]["keep"] == 3 and m["checkpoint"]["storage_uri"].startswith("file:///")
    assert m["budget"] == {"ceiling_usd": 500.0, "max_incremental_cost_usd": 0.0}
    assert "dedup" in m["data"] and "window" in m["loss_spike"]
    assert m["curriculum"]["phases"][0]["eval_battery"] == "smoke"  # gsm8k has no checks
    capsys.readouterr()

    # The printed commands work as written on the reviewed file.
    confirm = shlex.split(d["next"]["confirm"])[1:]
    status, env = world.cli(monkeypatch, [*confirm, "--json"], key=world.tenant.approver)
    assert status == EXIT_OK, env
    train = shlex.split(d["next"]["train"].split(" --confirmation-ref")[0])[1:]
    status, env = world.cli(
        monkeypatch,
        [
            *train,
            "--confirmation-ref",
            env["data"]["confirmation_ref"],
            "--idempotency-key",
            "init-key-0001",
            "--json",
        ],
    )
    assert status == EXIT_OK, env
    assert env["data"]["manifest_digest"] == d["manifest_digest"]
    capsys.readouterr()

    # The reviewed file is never overwritten.
    status, env = world.cli(
        monkeypatch,
        [
            "manifest",
            "init",
            "--booking",
            world.booking,
            "--model-size",
            "1B",
            "--data",
            str(data),
            "--target",
            "gsm8k",
            "--budget-usd",
            "1",
            "--output",
            str(out),
            "--json",
        ],
    )
    assert status == EXIT_REFUSED and env["error"]["code"] == "bad_request"
    assert out.read_bytes() == raw


def _init_then_confirm_and_train(
    world: World, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> dict:
    """Run ``manifest init`` and then the confirm and train commands it printed."""
    out = world.tmp / "review" / "m.json"
    out.parent.mkdir(exist_ok=True)
    status, env = world.cli(
        monkeypatch,
        [
            "manifest",
            "init",
            "--booking",
            world.booking,
            "--model-size",
            "1B",
            "--data",
            str(world.tmp / "data" / "train.jsonl"),
            "--target",
            "gsm8k",
            "--budget-usd",
            "500",
            "--output",
            str(out),
            *extra,
            "--json",
        ],
    )
    assert status == EXIT_OK, env  # the server accepted the plan of the file it wrote
    d = env["data"]
    confirm = shlex.split(d["next"]["confirm"])[1:]
    status, env = world.cli(monkeypatch, [*confirm, "--json"], key=world.tenant.approver)
    assert status == EXIT_OK, env
    train = shlex.split(d["next"]["train"].split(" --confirmation-ref")[0])[1:]
    status, env = world.cli(
        monkeypatch,
        [
            *train,
            "--confirmation-ref",
            env["data"]["confirmation_ref"],
            "--idempotency-key",
            "init-key-0002",
            "--json",
        ],
    )
    assert status == EXIT_OK, env
    m: dict = json.loads(out.read_bytes())
    return m


@pytest.fixture
def narrow_world(world: World) -> World:
    """A tenant whose data and checkpoint roots are two sibling folders, neither holding
    the reviewed manifest (the shape of a real deployment's roots)."""
    (world.tmp / "ckpt-root").mkdir()
    _data(world.tmp)
    name = f"{world.tenant.account}-narrow"
    tenant = make_tenant(
        world.backend.db,
        name,
        booking=booking_doc(f"bk-{name}", name),
        data_roots=(str(world.tmp / "data"),),
        checkpoint_roots=(str(world.tmp / "ckpt-root"),),
    )
    return World(world.backend, tenant, world.tmp, world.manifest)


def test_init_defaults_checkpoints_inside_the_accounts_checkpoint_root(
    narrow_world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    m = _init_then_confirm_and_train(narrow_world, monkeypatch, [])
    uri = m["checkpoint"]["storage_uri"]
    assert uri.startswith(f"file://{narrow_world.tmp / 'ckpt-root'}/"), uri
    capsys.readouterr()


def test_init_takes_checkpoint_dir(
    narrow_world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    chosen = narrow_world.tmp / "ckpt-root" / "team-a"
    m = _init_then_confirm_and_train(narrow_world, monkeypatch, ["--checkpoint-dir", str(chosen)])
    assert m["checkpoint"]["storage_uri"].startswith(f"file://{chosen}/")
    capsys.readouterr()


def test_eligibility_names_the_accounts_roots(
    narrow_world: World, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    status, env = narrow_world.cli(
        monkeypatch, ["eligibility", "--booking", narrow_world.booking, "--json"]
    )
    assert status == EXIT_OK, env
    assert env["data"]["roots"] == {
        "data": [str(narrow_world.tmp / "data")],
        "checkpoint": [str(narrow_world.tmp / "ckpt-root")],
    }
    capsys.readouterr()


@pytest.mark.parametrize(
    ("over", "code"),
    [
        ({"--model-size": "3T"}, "model_preset_unknown"),
        ({"--model-size": "eight"}, "bad_request"),
        ({"--target": "poetry"}, "eval_suite_unknown"),
        ({"--data": "/nonexistent/data.jsonl"}, "data_not_found"),
        ({"--budget-usd": "0"}, "bad_request"),
    ],
)
def test_init_refuses_locally_with_a_code_and_writes_nothing(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys, over: dict, code: str
) -> None:
    out = world.tmp / "init.json"
    flags = {
        "--booking": world.booking,
        "--model-size": "8B",
        "--data": str(_data(world.tmp)),
        "--target": "math",
        "--budget-usd": "100",
        "--output": str(out),
        **over,
    }
    status, env = world.cli(
        monkeypatch, ["manifest", "init", *[x for kv in flags.items() for x in kv], "--json"]
    )
    assert status == EXIT_REFUSED and env["error"]["code"] == code, env
    assert not out.exists()
    capsys.readouterr()
