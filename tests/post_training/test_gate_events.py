"""``ito status`` shows each post-training objective's gate as it shows a curriculum
phase's: the events the stage emits for an objective's gate, stored and read back
through the API's run view, rendered as the status command prints them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from helpers.store_rows import stage_run_view

from orchestrator.client.render import readable
from orchestrator.db.store import Store
from stages.evals.gates import CheckVerdict, GateDecision
from stages.post_training.config import ObjectiveGate
from stages.post_training.gate_events import objective_gate_events


def _rows(text: str) -> list[list[str]]:
    return [re.split(r" {3,}", line.strip()) for line in text.splitlines() if line.strip()]


def _recipe(**gates: Any) -> dict[str, Any]:
    """A manifest with an sft -> dpo -> rlvr recipe (only what the view reads is real)."""
    data = {
        "uri": "file:///data/x.jsonl",
        "sha256": "a" * 64,
        "provenance": {"source": "test", "license": "MIT"},
    }
    return {
        "post_training": {
            "sft": {
                "data": data,
                "steps": 40,
                "eval": {"battery": "smoke"},
                **gates.get("sft", {}),
            },
            "dpo": {"data": data, "steps": 10, **gates.get("dpo", {})},
            "rlvr": {"data": data, "steps": 6, **gates.get("rlvr", {})},
        }
    }


def _sft_and_dpo_decided() -> list[Any]:
    """The events the stage emits for a passed SFT gate (with a battery) and a failed DPO
    gate."""
    sft = objective_gate_events(
        "sft",
        ObjectiveGate(metric="nll_gain", min=0.5),
        {"nll_gain": 2.2812, "nll_before": 4.1, "nll_after": 1.8188, "seconds": 3.0},
        steps=40,
        battery=GateDecision(
            battery="smoke",
            phase="sft",
            passed=True,
            task_files={},
            checks=[
                CheckVerdict(check="heldout_loss", phase="sft", score=1.7, passed=True, max=6.0)
            ],
        ),
    )
    dpo = objective_gate_events(
        "dpo",
        ObjectiveGate(metric="margin_gain", min=0.5),
        {"margin_gain": 0.25, "margin_before": 0.0, "margin_after": 0.25},
        steps=10,
    )
    return [e.model_copy(update={"stage": "post_training"}) for e in [*sft, *dpo]]


_GATES = {
    "sft": {"gate": {"metric": "nll_gain", "min": 0.5}},
    "dpo": {"gate": {"metric": "margin_gain", "min": 0.5}},
}


def test_status_shows_each_objectives_gate_like_a_phases(tmp_path: Path) -> None:
    view = stage_run_view(
        Store(str(tmp_path / "ito.db")),
        "run_1",
        _recipe(**_GATES),
        _sft_and_dpo_decided(),
        state="failed",
    )
    # The API's field: each objective the manifest names, its gate, value and verdict.
    assert view["post_training_gates"] == [
        {
            "objective": "sft",
            "phase": "post_training.sft",
            "status": "passed",
            "metric": "nll_gain",
            "min": 0.5,
            "value": 2.2812,
            "battery": "smoke",
            "steps": 40,
            "reason": "",
        },
        {
            "objective": "dpo",
            "phase": "post_training.dpo",
            "status": "failed",
            "metric": "margin_gain",
            "min": 0.5,
            "value": 0.25,
            "battery": None,
            "steps": 10,
            "reason": "dpo: margin_gain = 0.25 < 0.5",
        },
        # The run failed at DPO's gate: RLVR (its default gate) was never decided.
        {
            "objective": "rlvr",
            "phase": "post_training.rlvr",
            "status": "not_run",
            "metric": "reward_gain",
            "min": 0.0,
            "value": None,
            "battery": None,
            "steps": 6,
            "reason": "",
        },
    ]
    gates = {g["phase"]: g for g in view["eval_gates"]}
    assert gates["post_training.sft"]["passed"] is True
    assert gates["post_training.dpo"]["passed"] is False
    text = readable("status", view)
    rows = _rows(text)
    # Name, score, bound, verdict: the objective's gate metric, the scores it comes from,
    # and the battery the objective named, each a row as a phase's checks are.
    assert ["nll_gain", "2.281", "min 0.5", "ok"] in rows
    assert ["nll_before", "4.1", "-", "ok", "ran (no bound)"] in rows
    assert ["heldout_loss", "1.7", "max 6", "ok"] in rows
    assert ["margin_gain", "0.25", "min 0.5", "FAIL", "dpo: margin_gain = 0.25 < 0.5"] in rows
    heads = [
        line.strip()
        for line in text.splitlines()
        if "gate post_training" in line or "objective gate" in line
    ]
    assert heads == [
        "objective gate sft (gate nll_gain 2.281, min 0.5, battery smoke, step 40): passed",
        "objective gate dpo (gate margin_gain 0.25, min 0.5, step 10): FAILED",
        "objective gate rlvr (gate reward_gain, min 0, step 6): not run",
    ]
    # Each check once: under its objective, not again as an eval gate of its own.
    assert sum(row[0] == "nll_gain" for row in rows) == 1


def test_a_live_run_shows_the_objectives_to_come_as_pending(tmp_path: Path) -> None:
    view = stage_run_view(
        Store(str(tmp_path / "ito.db")),
        "run_1",
        _recipe(**_GATES, rlvr={"gate": None, "eval": {"battery": "smoke"}}),
        _sft_and_dpo_decided()[:4],  # SFT's gate decided; DPO still training
        state="running",
    )
    assert [(g["objective"], g["status"], g["value"]) for g in view["post_training_gates"]] == [
        ("sft", "passed", 2.2812),
        ("dpo", "pending", None),
        ("rlvr", "pending", None),
    ]
    heads = [
        line.strip() for line in readable("status", view).splitlines() if "objective gate" in line
    ]
    assert heads[1:] == [
        "objective gate dpo (gate margin_gain, min 0.5, step 10): pending",
        "objective gate rlvr (no gate metric, battery smoke, step 6): pending",
    ]


def test_a_run_without_post_training_shows_no_objective_gates(tmp_path: Path) -> None:
    view = stage_run_view(Store(str(tmp_path / "ito.db")), "run_1", {}, [], state="running")
    assert view["post_training_gates"] == []
    assert "objective gate" not in readable("status", view)


def test_an_objective_without_a_gate_reports_its_scores_unbounded() -> None:
    events = objective_gate_events("rlvr", None, {"reward_first": 0.1, "reward_last": 0.3}, steps=4)
    assert [(e.check, e.passed, e.min) for e in events] == [
        ("reward_first", True, None),
        ("reward_last", True, None),
    ]
