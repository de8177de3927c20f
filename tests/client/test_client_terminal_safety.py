"""Human output cannot be forged: a tenant-controlled string (phase, check, file, stage
and log text, messages, notices) that carries an ANSI escape, a carriage return, a
newline or another control character reaches the terminal escaped, never raw. ``--json``
keeps the string exactly as sent (JSON escapes it itself)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from orchestrator.client.cli import _cmd_follow_logs, _cmd_follow_status, _Out

# What a hostile tenant puts in a name or a log line: clear the screen, rewrite the line,
# forge a line of its own, and reorder text (a bidi override, a C1 CSI).
CLEAR = "\x1b[2J"
FORGED = "run run_other  state=succeeded"
HOSTILE = f"x{CLEAR}\r{FORGED}\n{FORGED}\u202e\x9b31m\x07\x00"


def _run(**over: Any) -> dict[str, Any]:
    run = {
        "run_id": "run_1",
        "state": "failed",
        "state_reason": HOSTILE,
        "booking_id": "bk",
        "manifest_id": "m",
        "idempotency_key": "k",
        "cost_estimate_usd": 1.0,
        "stage_gates": [{"stage": "data_prep", "status": "failed", "reason": HOSTILE}],
        "eval_gates": [
            {
                "phase": HOSTILE,
                "battery": HOSTILE,
                "step": 5,
                "passed": False,
                "checks": [
                    {"check": HOSTILE, "score": 1.5, "passed": False, "reason": HOSTILE, "max": 1.0}
                ],
            }
        ],
        "post_training_gates": [
            {
                "objective": HOSTILE,
                "phase": HOSTILE,
                "status": HOSTILE,
                "metric": HOSTILE,
                "min": 0.5,
                "value": 0.25,
                "battery": HOSTILE,
                "steps": HOSTILE,
                "reason": HOSTILE,
            }
        ],
        "proposals": [
            {"proposal_id": "p1", "status": "pending", "action": "restart", "description": HOSTILE}
        ],
    }
    return {**run, **over}


CASES: list[tuple[str, dict[str, Any]]] = [
    ("status", _run()),
    ("logs", {"entries": [{"ts": 0, "level": "info", "stage": HOSTILE, "message": HOSTILE}]}),
    (
        "checkpoints",
        {
            "checkpoints": [
                {
                    "step": 1,
                    "bytes": 10,
                    "blocking_s": 0.1,
                    "total_s": 0.2,
                    "bytes_per_s": 50.0,
                    "path": HOSTILE,
                    "phase": HOSTILE,
                    "closes_phase": True,
                }
            ]
        },
    ),
    (
        "metrics",
        {
            "goodput": 0.5,
            "eval_scores": [{"phase": HOSTILE, "check": HOSTILE, "score": 0.5, "passed": True}],
            "stage_progress": {"stage": HOSTILE, "step": HOSTILE, "step_index": 0, "steps": 1},
        },
    ),
    (
        "plan",
        {
            "manifest_id": "m",
            "manifest_digest": "d",
            "booking_id": "bk",
            "cost_estimate_usd": 1.0,
            "plan": None,
            "plan_refusal": {"code": "plan_no_feasible", "message": HOSTILE},
            "validation": {
                "model_preset": HOSTILE,
                "curriculum": {
                    "phases": [
                        {
                            "name": HOSTILE,
                            "kind": "pretrain",
                            "steps": [0, 5],
                            "token_budget": 10,
                            "seq_len": 64,
                            "battery": HOSTILE,
                            "gates": [{"metric": HOSTILE}],
                        }
                    ]
                },
            },
        },
    ),
]


def _assert_terminal_safe(text: str) -> None:
    assert CLEAR not in text and "\x1b" not in text and "\r" not in text
    assert all(ch.isprintable() for line in text.split("\n") for ch in line), repr(text)
    # The forged line never starts a line of its own.
    assert not any(line.startswith(FORGED) for line in text.split("\n"))
    assert "\\x1b[2J" in text  # shown, escaped, so a reader sees what was sent


@pytest.mark.parametrize(("command", "data"), CASES, ids=[c for c, _ in CASES])
def test_tenant_strings_reach_the_terminal_escaped(command: str, data: dict, capsys) -> None:
    env = {"ok": True, "live_api_contacted": True, "notice": HOSTILE, "data": data}
    _Out(as_json=False).final(command, env)
    out = capsys.readouterr()
    _assert_terminal_safe(out.out)
    _assert_terminal_safe(out.err)


def test_error_messages_reach_the_terminal_escaped(capsys) -> None:
    env = {
        "ok": False,
        "live_api_contacted": True,
        "notice": HOSTILE,
        "error": {"code": "stage_failed", "message": HOSTILE},
    }
    _Out(as_json=False).final("status", env)
    out = capsys.readouterr()
    assert out.out == ""
    _assert_terminal_safe(out.err)
    assert out.err.startswith("error [stage_failed] (server): x\\x1b[2J\\r")


class _Following:
    """Stands in for ItoClient's follow loops (their polling is tested against a real
    server elsewhere): each hands the CLI one hostile update."""

    def follow_status(self, run_id: str, on_update: Any, with_progress: bool) -> dict:
        on_update({"ok": True, "data": {"run_id": HOSTILE, "state": HOSTILE, "step": HOSTILE}})
        return {"ok": True, "data": {"run_id": run_id, "state": "running"}}

    def follow_logs(self, run_id: str, on_entries: Any, cursor: Any = None) -> dict:
        on_entries([{"ts": 0, "level": HOSTILE, "stage": HOSTILE, "message": HOSTILE}])
        return {"ok": True, "data": {"run_id": run_id, "state": "running"}}


def test_follow_progress_lines_are_escaped(capsys) -> None:
    args = argparse.Namespace(run="run_1", cursor=None)
    _cmd_follow_status(_Following(), args, _Out(as_json=False))  # type: ignore[arg-type]
    _cmd_follow_logs(_Following(), args, _Out(as_json=False))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 2
    _assert_terminal_safe(out)


@pytest.mark.parametrize(("command", "data"), CASES, ids=[c for c, _ in CASES])
def test_json_keeps_the_strings_as_sent(command: str, data: dict, capsys) -> None:
    env = {"ok": True, "live_api_contacted": True, "notice": HOSTILE, "data": data}
    _Out(as_json=True).final(command, env)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out  # JSON's own escapes
    assert json.loads(out) == env
