"""A phase end's battery is cut into units (each lm-eval task, the held-out windows in
shares) that rank 0 of every live group takes, the next one whichever is free, the
tasks first; every rank of the live groups writes its export shares before it takes a
unit; the evaluating rank (rank 0 of the lowest live group) is then asked to assemble
the battery with the reduced held-out sums and every task's checks.

Real Ray actors stand in for the ranks (no model: the units' scoring is
``tests/curriculum/test_phases_ray.py``'s): they record what they were asked, and one
group's rank is slow, so the other must take more of the units.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from stages.curriculum.schedule import PhaseSpan
from stages.evals.battery import lm_eval_tasks
from stages.evals.config import EvalRunSettings, load_battery
from stages.trainer.phase_eval import (
    HELDOUT_SHARES_PER_GROUP,
    PhaseEvalRequest,
    evaluate_phase_end,
)

SLOW_UNIT_S = 1.0
TIMEOUT_S = 120.0


def _request() -> PhaseEvalRequest:
    phase = PhaseSpan(
        index=0,
        name="pretrain",
        kind="pretrain",
        start_step=0,
        end_step=10,
        seq_len=32,
        token_budget=320,
        data_weights={"baseline": 1.0},
        eval_battery="smoke",
        peak_lr=1e-3,
        warmup_steps=1,
        decay_steps=1,
        min_lr_ratio=0.1,
    )
    return PhaseEvalRequest(
        phase=phase,
        checkpoint="/nonexistent/step_10",
        step=10,
        heldout_path="/nonexistent/heldout.jsonl",
        tokenizer_dir="/nonexistent/tokenizer",
        work_dir="/nonexistent",
        export_dir="/nonexistent/hf/pretrain",
        metadata={},
        settings=EvalRunSettings(),
    )


def _rank_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, name: str, unit_s: float) -> None:
            self.name, self.unit_s, self.calls = name, unit_s, []

        def export_share(self, request: dict[str, Any], part: int, parts: int) -> dict[str, str]:
            self.calls.append(("export_share", part, parts))
            return {f"model-{part}.safetensors": self.name}

        def eval_unit(self, request: dict[str, Any], unit: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(("eval_unit", unit))
            time.sleep(self.unit_s)
            if unit["task"] is not None:
                checks = lm_eval_tasks(load_battery("smoke"))[unit["task"]]
                return {
                    "checks": [
                        {
                            "name": c.name,
                            "kind": c.kind,
                            "metric": c.metric,
                            "higher_is_better": c.higher_is_better,
                            "score": 0.5,
                            "status": "ok",
                        }
                        for c in checks
                    ]
                }
            # One batch a share, scored 1 nat a token over 10 tokens of 20 bytes.
            sums = {"batch_nats": {unit["part"]: 10.0}, "tokens": 10, "bytes": 20.0}
            return {"heldout": sums}

        def evaluate_phase(self, request: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(("evaluate_phase", request))
            return {"result": {}, "export": request["export_dir"], "live_model": True}

        def asked(self) -> list[Any]:
            return self.calls

    return Rank


@pytest.mark.usefixtures("ray_local")
def test_units_go_to_whichever_group_is_free_and_the_lowest_group_assembles() -> None:
    import ray

    rank = _rank_class()
    # Group 0 has two ranks (both write export shares, only rank 0 takes units); group 1
    # is slow; group 2 was lost: it gets nothing.
    actors = {
        (0, 0): rank.remote("rg0/rank0", 0.0),
        (0, 1): rank.remote("rg0/rank1", 0.0),
        (1, 0): rank.remote("rg1/rank0", SLOW_UNIT_S),
        (2, 0): rank.remote("rg2/rank0", 0.0),
    }
    req = _request()
    units = req.units(2)
    tasks = lm_eval_tasks(load_battery("smoke"))
    assert [u.task for u in units[: len(tasks)]] == list(tasks)  # the tasks first
    assert len(units) == len(tasks) + HELDOUT_SHARES_PER_GROUP * 2
    # No more shares than the held-out split can have batches: one window, one share.
    one_window = req.model_copy(
        update={"settings": EvalRunSettings(heldout_max_tokens=req.phase.seq_len)}
    )
    assert [(u.part, u.parts) for u in one_window.units(64) if u.task is None] == [(0, 1)]

    reply = evaluate_phase_end(actors, [0, 1], req.model_dump(mode="json"), TIMEOUT_S)
    assert reply["export"] == req.export_dir
    asked = {k: ray.get(a.asked.remote()) for k, a in actors.items()}
    assert asked[(2, 0)] == []
    ran = {k: [c[1] for c in calls if c[0] == "eval_unit"] for k, calls in asked.items()}
    assert ran[(0, 1)] == []
    # Every unit ran once, on rank 0 of a live group; the fast group took the most.
    every = sorted(ran[(0, 0)] + ran[(1, 0)], key=lambda u: (u["task"] or "", u["part"]))
    assert every == sorted(
        (u.model_dump(mode="json") for u in units), key=lambda u: (u["task"] or "", u["part"])
    )
    assert ran[(1, 0)] and len(ran[(0, 0)]) > len(ran[(1, 0)])
    # Dispatched in the units' order, the tasks first (a generation task is the
    # longest unit: started last, it would keep every other group idle behind it).
    # Each free worker took the next unit: the first two went out one a group, and no
    # group ran a held-out share before a task.
    assert [ran[(0, 0)][0]["task"], ran[(1, 0)][0]["task"]] == list(tasks)
    for k in [(0, 0), (1, 0)]:
        kinds = [u["task"] is None for u in ran[k]]
        assert kinds == sorted(kinds), (k, ran[k])
    # Export shares before any unit, on every rank of the live groups.
    for k in [(0, 0), (0, 1), (1, 0)]:
        assert asked[k][0][0] == "export_share"
    # The lowest live group's rank 0 assembles, with everything the units found.
    final = [c[1] for c in asked[(0, 0)] if c[0] == "evaluate_phase"]
    assert len(final) == 1 and asked[(0, 0)][-1][0] == "evaluate_phase"
    assembled = final[0]
    shares = HELDOUT_SHARES_PER_GROUP * 2
    assert assembled["heldout_sums"]["tokens"] == 10 * shares
    assert sorted(int(b) for b in assembled["heldout_sums"]["batch_nats"]) == list(range(shares))
    checks = {c["name"] for c in assembled["task_checks"]}
    assert checks == {c.name for cs in tasks.values() for c in cs}
    assert set(assembled["export_writers"].values()) == {"rg0/rank0", "rg0/rank1", "rg1/rank0"}
    for a in actors.values():
        ray.kill(a)
