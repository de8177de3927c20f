"""``ito status`` shows each post-training objective's gate as it shows a curriculum
phase's: the events the stage emits for an objective's gate, stored and read back
through the API's run view, rendered as the status command prints them."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.store_rows import insert_run

from orchestrator.api.deps import eval_gates
from orchestrator.client.render import readable
from orchestrator.db.store import Store
from stages.evals.gates import CheckVerdict, GateDecision
from stages.post_training.config import ObjectiveGate
from stages.post_training.gate_events import objective_gate_events


def _rows(text: str) -> list[list[str]]:
    return [re.split(r" {3,}", line.strip()) for line in text.splitlines() if line.strip()]


def _stored_run(tmp: Path) -> Store:
    store = Store(str(tmp / "ito.db"))
    insert_run(store, "run_1", idempotency_key="k1", state="failed")
    return store


def test_status_shows_each_objectives_gate_like_a_phases(tmp_path: Path) -> None:
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
    store = _stored_run(tmp_path)
    events = [
        {**e.model_copy(update={"stage": "post_training"}).model_dump(mode="json"), "seq": i}
        for i, e in enumerate([*sft, *dpo])
    ]
    assert store.ingest_events("run_1", events) == len(events)

    gates = {g["phase"]: g for g in eval_gates(store.run_view_rows("run_1").eval_events)}
    assert gates["post_training.sft"]["passed"] is True
    assert gates["post_training.dpo"]["passed"] is False
    rows = _rows(
        readable(
            "status", {"run_id": "run_1", "state": "failed", "eval_gates": list(gates.values())}
        )
    )
    # Name, score, bound, verdict: the objective's gate metric, the scores it comes from,
    # and the battery the objective named, each a row as a phase's checks are.
    assert ["nll_gain", "2.281", "min 0.5", "ok"] in rows
    assert ["nll_before", "4.1", "-", "ok", "ran (no bound)"] in rows
    assert ["heldout_loss", "1.7", "max 6", "ok"] in rows
    assert ["margin_gain", "0.25", "min 0.5", "FAIL", "dpo: margin_gain = 0.25 < 0.5"] in rows
    text = readable(
        "status", {"run_id": "run_1", "state": "failed", "eval_gates": list(gates.values())}
    )
    assert "eval gate post_training.sft (battery objective, step 40): passed" in text
    assert "eval gate post_training.dpo (battery objective, step 10): FAILED" in text


def test_an_objective_without_a_gate_reports_its_scores_unbounded() -> None:
    events = objective_gate_events("rlvr", None, {"reward_first": 0.1, "reward_last": 0.3}, steps=4)
    assert [(e.check, e.passed, e.min) for e in events] == [
        ("reward_first", True, None),
        ("reward_last", True, None),
    ]
