"""Readable output: numbers for people and small aligned tables with units; --json keeps
full precision."""

from __future__ import annotations

import json

import pytest

from orchestrator.client import human
from orchestrator.client.cli import _Out
from orchestrator.client.render import readable

CKPT = {
    "step": 20,
    "bytes": 7961073,
    "blocking_s": 0.010281820000045627,
    "total_s": 1.2345678,
    "bytes_per_s": 7961073.57,
    "path": "/ckpt/step-20",
}


@pytest.mark.parametrize(
    ("fn", "arg", "text"),
    [
        (human.duration, 0.010281820000045627, "10.3 ms"),
        (human.duration, 0.0004, "0.40 ms"),
        (human.duration, 1.2345, "1.23 s"),
        (human.duration, 252, "4 min 12 s"),
        (human.duration, 7500, "2 h 05 min"),
        (human.size, 512, "512 B"),
        (human.size, 7961073, "7.59 MiB"),
        (human.size, 3 * 2**30, "3.00 GiB"),
        (human.rate, 7961073.57, "7.59 MiB/s"),
        (human.ratio, 0.92345, "92.3%"),
        (human.usd, 1234.5, "$1,234.50"),
        (human.usd, 3.2e-05, "< $0.01"),
        (human.score, 3.2311687772236173, "3.231"),
        (human.score, None, "-"),
    ],
)
def test_formats(fn, arg, text: str) -> None:
    assert fn(arg) == text


def _rows(text: str) -> list[list[str]]:
    """A table's lines split on its column gaps (3+ spaces)."""
    import re

    return [re.split(r" {3,}", line.strip()) for line in text.splitlines() if line.strip()]


def test_checkpoints_print_a_table_with_units() -> None:
    text = readable("checkpoints", {"checkpoints": [CKPT]})
    assert _rows(text) == [
        ["STEP", "SIZE", "BLOCKING", "TOTAL", "BANDWIDTH", "PHASE", "PATH"],
        ["20", "7.59 MiB", "10.3 ms", "1.23 s", "7.59 MiB/s", "-", "/ckpt/step-20"],
    ]


METRICS = {
    "goodput": 0.81234567,
    "elapsed_s": 87.123456,
    "tokens_per_s": 9091.2345,
    "rollout_samples_per_s": 8.4871,
    "checkpoint_bytes_per_s": 7961073.57,
    "badput_s": {"startup": 12.345678},
    "interruption_rate_per_h": 41.3793103,
    "tokens": 123456,
    "recover_s": [2.5],
    "interruption_timings": [
        {
            "index": 0,
            "kind": "replica_group_lost",
            "replica_group": 1,
            "detect_s": 0.61234,
            "recover_s": 2.5,
        },
        {
            "index": 1,
            "kind": "loss_spike",
            "replica_group": None,
            "detect_s": None,
            "recover_s": None,
        },
    ],
    "eval_scores": [
        {"phase": "pretrain", "check": "heldout_loss", "score": 3.2311687772236173, "passed": True},
        {"phase": "pretrain", "check": "arith_mc_acc", "score": 0.25, "passed": False},
    ],
    "stage_progress": {
        "stage": "data_prep",
        "step": "fetch",
        "step_index": 3,
        "steps": 7,
        "tasks_done": 12,
        "tasks_total": 80,
        "docs_done": 240000,
        "docs_total": 1600000,
        "bytes_done": 132000000,
        "bytes_total": 880000000,
        "elapsed_s": 120.0,
        "eta_s": 95.4,
        "ts": 1796000000.0,
    },
}


def test_metrics_print_tables_with_units_and_no_raw_floats() -> None:
    text = readable("metrics", METRICS)
    scalars, badput, timings, scores, progress = (_rows(t) for t in text.split("\n\n"))
    assert scalars[0] == ["METRIC", "VALUE"]
    assert ["goodput", "81.2%"] in scalars and ["elapsed_s", "1 min 27 s"] in scalars
    assert ["tokens_per_s", "9,091 tokens/s"] in scalars
    assert ["rollout_samples_per_s", "8.49 samples/s"] in scalars  # a rate, not a duration
    assert ["checkpoint_bytes_per_s", "7.59 MiB/s"] in scalars
    assert ["interruption_rate_per_h", "41.38 /h"] in scalars
    assert ["recover_s", "[2.50 s]"] in scalars
    assert badput == [["BADPUT CAUSE", "TIME"], ["startup", "12.3 s"]]
    assert timings == [
        ["INTERRUPTION", "KIND", "GROUP", "DETECT", "RECOVER"],
        ["0", "replica_group_lost", "1", "612 ms", "2.50 s"],
        ["1", "loss_spike", "-", "-", "-"],
    ]
    assert scores == [
        ["PHASE", "CHECK", "SCORE", "RESULT"],
        ["pretrain", "heldout_loss", "3.231", "ok"],
        ["pretrain", "arith_mc_acc", "0.25", "FAIL"],
    ]
    assert progress == [
        ["STAGE", "STEP", "TASKS", "DOCUMENTS", "BYTES", "ELAPSED", "ETA"],
        [
            "data_prep",
            "fetch (4/7)",
            "12/80",
            "240,000/1,600,000",
            "126 MiB/839 MiB",
            "2 min 00 s",
            "1 min 35 s",
        ],
    ]
    for raw in ("0.81234567", "7961073.57", "3.2311687772236173", "1.796e+09", "ts ", "0.61234"):
        assert raw not in text


PLAN = {
    "manifest_id": "mf_1",
    "manifest_digest": "ab" * 32,
    "booking_id": "bk-1",
    "cost_estimate_usd": 12.5,
    "incremental_cost_usd": 0.0,
    "plan_refusal": None,
    "plan": {
        "model": "llama-tiny",
        "gpu_sku": "cpu-testbed",
        "fabric": "loopback",
        "gpus_per_node": 2,
        "node_count": 1,
        "world_size": 2,
        "global_batch_tokens": 512,
        "seq_len": 64,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "dp_shard": 1,
        "dp_replicate": 2,
        "micro_batch": 4,
        "grad_accum": 1,
        "activation_checkpointing": "none",
        "precision": "fp32",
        "peak_memory_gib": 0.053,
        "memory": {"capacity": 7.2},
        "step_time_s": 0.022736,
        "tokens_per_s": 22519.212,
        "mfu": 0.1675,
        "reasons": ["fastest of 3 candidate layouts"],
        "rejected": [
            {
                "rank": 1,
                "layout": "tp1 pp1 cp1 fsdp1 rep2 mb2 ac=none fp32",
                "reason": "feasible but 2.6% slower",
                "tokens_per_s": 21940.216,
                "mfu": 0.1632,
                "peak_memory_gib": 0.052,
            }
        ],
    },
    "validation": {
        "model_preset": "ok",
        "cost": {
            "gpus": 2,
            "usd_per_gpu_hour": 2.5,
            "hours": 0.5,
            "total_usd": 2.5,
            "method": "planner_step_time",
        },
        "curriculum": {
            "phases": [
                {
                    "name": "pretrain",
                    "kind": "pretrain",
                    "steps": [0, 50],
                    "token_budget": 25600,
                    "seq_len": 64,
                    "battery": "smoke",
                    "gates": [],
                },
                {
                    "name": "long_context",
                    "kind": "long_context",
                    "steps": [50, 100],
                    "token_budget": 25600,
                    "seq_len": 128,
                    "battery": "smoke",
                    "gates": [{"metric": "heldout_loss", "max_regression": 0.5}],
                },
            ],
            "post_training": [],
        },
    },
}


def test_plan_prints_tables_not_json() -> None:
    text = readable("plan", PLAN)
    assert "{" not in text and "curriculum:" not in text
    rows = _rows(text)
    assert [
        "cost",
        "gpus 2, usd_per_gpu_hour $2.50/gpu hour, hours 30 min 00 s, total_usd "
        "$2.50, method planner_step_time",
    ] in rows
    assert [
        "layout",
        "tp 1  pp 1  cp 1  fsdp 1  replicas 2  micro-batch 4  grad-accum 1  "
        "recompute none  precision fp32",
    ] in rows
    assert ["step time", "22.7 ms, 22,519 tokens/s, MFU 16.8%"] in rows
    assert [
        "1",
        "tp1 pp1 cp1 fsdp1 rep2 mb2 ac=none fp32",
        "21,940",
        "16.3%",
        "0.052 GiB",
        "feasible but 2.6% slower",
    ] in rows
    assert ["PHASE", "KIND", "STEPS", "TOKENS", "SEQ LEN", "BATTERY", "GATES"] in rows
    assert [
        "long_context",
        "long_context",
        "50-100",
        "25,600",
        "128",
        "smoke",
        "heldout_loss max_regression=0.5",
    ] in rows


def test_a_refused_plan_says_why() -> None:
    text = readable(
        "plan",
        {
            **PLAN,
            "plan": None,
            "plan_refusal": {"code": "plan_no_feasible", "message": "no layout fits"},
        },
    )
    assert "plan: none (plan_no_feasible: no layout fits)" in text


def test_status_prints_gate_scores_rounded_in_a_table() -> None:
    run = {
        "run_id": "run_1",
        "state": "succeeded",
        "eval_gates": [
            {
                "phase": "pretrain",
                "battery": "smoke",
                "step": 50,
                "passed": True,
                "checks": [
                    {
                        "check": "heldout_loss",
                        "score": 3.2311687772236173,
                        "passed": True,
                        "reason": "within bounds",
                        "max": 6.0,
                    },
                    {
                        "check": "heldout_loss",
                        "score": 3.2311687772236173,
                        "passed": True,
                        "reason": "within bounds",
                        "max": 6.0,
                        "max_regression": 0.5,
                        "previous": 3.3,
                    },
                ],
            }
        ],
    }
    text = readable("status", run)
    assert "3.2311687772236173" not in text
    rows = _rows(text)
    assert ["CHECK", "SCORE", "BOUND", "RESULT", "REASON"] in rows
    assert ["heldout_loss", "3.231", "max 6", "ok", "within bounds"] in rows
    assert [
        "heldout_loss",
        "3.231",
        "max 6, max regression 0.5 (previous 3.3)",
        "ok",
        "within bounds",
    ] in rows


def test_json_output_keeps_full_precision(capsys) -> None:
    env = {"ok": True, "live_api_contacted": True, "notice": "", "data": {"checkpoints": [CKPT]}}
    _Out(as_json=True).final("checkpoints", env)
    assert json.loads(capsys.readouterr().out)["data"]["checkpoints"][0] == CKPT


def test_plan_shows_the_replica_groups_sync_and_why() -> None:
    reason = (
        "replicate allreduce 9.89 s = 89% of the 11.1 s step on ethernet: DiLoCo every "
        "82 steps, sync 9% of the 1.33 s step"
    )
    plan = {
        **PLAN["plan"],  # type: ignore[dict-item]
        "sync": {
            "mode": "diloco",
            "sync_every": 82,
            "fragments": 1,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        },
        "step_time_by_sync": {"every_step": 11.097563, "diloco": 1.331489},
        "reasons": [reason],
    }
    rows = _rows(readable("plan", {**PLAN, "plan": plan}))
    assert [
        "sync",
        "DiLoCo every 82 steps (outer Nesterov lr 0.7, momentum 0.9); predicted step "
        "every step 11.1 s, diloco 1.33 s",
    ] in rows
    assert ["why", reason] in rows
    every = {**plan, "sync": {"mode": "every_step"}, "step_time_by_sync": {"every_step": 0.02}}
    assert ["sync", "every step"] in _rows(readable("plan", {**PLAN, "plan": every}))


def test_plan_shows_the_gpus_held_for_the_rollout_workers() -> None:
    plan = {**PLAN["plan"], "gpus_per_node": 4, "rollout_gpus_per_node": 4}  # type: ignore[dict-item]
    rows = _rows(readable("plan", {**PLAN, "plan": plan}))
    assert ["rollout", "4 GPU(s) a node for RLVR's rollout workers, beside the trainer's 4"] in rows
    # None held (no RLVR, or the CPU testbed): no row.
    assert not [r for r in _rows(readable("plan", PLAN)) if r[:1] == ["rollout"]]
