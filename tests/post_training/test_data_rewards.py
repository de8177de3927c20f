"""Dataset validation codes, the strict numeric reward, and the stage's gates (local
fleet: in-process rollout workers; the Ray fleet is test_fleet_ray.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.store_rows import stage_run_view
from helpers.tenants import DEFAULT_ROOTS

from orchestrator.client import human
from orchestrator.client.render import readable
from orchestrator.db.store import Store
from stages.base import StageContext
from stages.errors import ErrorCode, ItoError
from stages.post_training.data import load_rows
from stages.post_training.rewards import get_reward, gsm8k_exact_match, parse_number
from tests.post_training.conftest import base_model, data_ref


def _write(tmp: Path, rows: list[Any], name: str = "d.jsonl") -> str:
    p = tmp / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return f"file://{p}"


@pytest.mark.parametrize(
    "kind,row,why",
    [
        ("sft", {"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ("sft", {"messages": [{"role": "robot", "content": "hi"}]}, "role must be"),
        ("sft", {"text": "plain"}, "messages must be"),
        ("dpo", {"prompt": "p", "chosen": "c"}, "missing rejected"),
        (
            "dpo",
            {
                "prompt": [{"role": "user", "content": "p"}],
                "chosen": "c",
                "rejected": [{"role": "assistant", "content": "r"}],
            },
            "chosen must be",
        ),
        ("rlvr", {"prompt": "What is 2+2?", "answer": "four"}, "no number"),
        ("rlvr", {"prompt": "", "answer": "4"}, "prompt is empty"),
        ("rlvr", "not json", "not UTF-8 JSON"),
    ],
)
def test_bad_rows_fail_with_a_clear_code(tmp_path: Path, kind: Any, row: Any, why: str) -> None:
    good = {
        "sft": {
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        },
        "dpo": {"prompt": "p", "chosen": "c", "rejected": "r"},
        "rlvr": {"question": "1+1?", "answer": "#### 2"},
    }[kind]
    with pytest.raises(ItoError) as e:
        load_rows(kind, _write(tmp_path, [good, row]))
    assert e.value.code == ErrorCode.post_training_data_invalid
    assert "d.jsonl:2" in e.value.message and why in e.value.message


def test_missing_and_empty_data(tmp_path: Path) -> None:
    with pytest.raises(ItoError) as e:
        load_rows("sft", f"file://{tmp_path}/none.jsonl")
    assert e.value.code == ErrorCode.data_not_found
    with pytest.raises(ItoError) as e:
        load_rows("sft", _write(tmp_path, []))
    assert e.value.code == ErrorCode.data_empty


def test_gsm8k_train_file_is_valid_rlvr_data() -> None:
    repo = Path(__file__).resolve().parents[2]
    rows = load_rows("rlvr", f"file://{repo / 'data' / 'gsm8k' / 'train.jsonl'}")
    assert len(rows) > 100
    assert all(gsm8k_exact_match(r["answer"], r["answer"]) == 1.0 for r in rows[:200])


@pytest.mark.parametrize(
    "text,value",
    [
        ("so the answer is #### 1,234", "1234"),
        ("\\boxed{-3.5}", "-3.5"),
        ("first 3 then 7", "7"),
        ("12,34", "34"),
        ("no digits", None),
        ("x1 y", None),
    ],
)
def test_parse_number_is_strict(text: str, value: str | None) -> None:
    got = parse_number(text)
    assert (str(got) if got is not None else None) == value


def test_exact_match_and_registry() -> None:
    assert gsm8k_exact_match("... #### 72", "#### 72") == 1.0
    assert gsm8k_exact_match("72.0", "#### 72") == 1.0
    assert gsm8k_exact_match("#### 73", "#### 72") == 0.0
    assert gsm8k_exact_match("I don't know", "#### 72") == 0.0
    assert get_reward("first_number_match")("7 or 8", "8") == 0.0
    with pytest.raises(ItoError) as e:
        get_reward("os.system")
    assert e.value.code == ErrorCode.reward_unknown


def _stage(tmp: Path, policy: Path, task: dict[str, Path], **over: Any) -> Any:
    from stages.post_training import PostTrainingStage, PostTrainingStageConfig

    recipe: dict[str, Any] = {
        **base_model(policy),
        "sft": {"data": data_ref(task["sft"]), "steps": 4, "learning_rate": 5e-3},
        "rlvr": {
            "data": data_ref(task["rlvr"]),
            "steps": 2,
            "reward": "first_number_match",
            "group_size": 4,
            "groups_per_step": 2,
            "max_completion_tokens": 4,
            "overlong_buffer_tokens": 1,
            "learning_rate": 1e-2,
        },
        **over,
    }
    return PostTrainingStage(
        PostTrainingStageConfig.model_validate(
            {
                "recipe": recipe,
                "output_dir": str(tmp / "out"),
                "fleet": "local",
                "data_roots": DEFAULT_ROOTS,
                "model_roots": DEFAULT_ROOTS,
            }
        )
    )


def _view(tmp: Path, stage: Any, events: list[Any]) -> dict[str, Any]:
    """The failed run's view, its manifest the stage's recipe, its events the stage's."""
    manifest = {"post_training": stage.config.recipe.model_dump(mode="json")}
    return stage_run_view(Store(str(tmp / "ito.db")), "r", manifest, events, state="failed")


@pytest.mark.timeout(600)  # a stage run on Ray: a hang bound for a loaded box
def test_a_failed_gate_stops_the_chain(
    ray_local: None, tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    stage = _stage(
        tmp_path,
        tiny_policy,
        task_files,
        sft={
            "data": data_ref(task_files["sft"]),
            "steps": 2,
            "learning_rate": 5e-3,
            "gate": {"metric": "nll_gain", "min": 1e9},
        },
    )
    events: list[Any] = []
    out = stage.run(StageContext(run_id="r", booking_id="b", workdir=tmp_path, emit=events.append))
    assert out.status == "failed" and out.error_code == ErrorCode.eval_gate_failed
    assert "sft: nll_gain" in out.reason
    # The objective's gate is reported as a phase's is (ito status): bound and verdict.
    gate = [e for e in events if e.kind == "eval" and e.phase == "post_training.sft"]
    assert [(e.check, e.min, e.passed) for e in gate if e.min is not None] == [
        ("nll_gain", 1e9, False)
    ]
    assert {e.check for e in gate} >= {"nll_before", "nll_after"}
    assert all(e.stage == "post_training" and e.step == 2 for e in gate)
    assert (tmp_path / "out" / "sft" / "config.json").is_file()  # saved before its gate
    assert not (tmp_path / "out" / "rlvr").exists()  # never started
    # What the stage emitted, stored and read back as the API's run view and ito status.
    view = _view(tmp_path, stage, events)
    sft, rlvr = view["post_training_gates"]
    measured = next(e.score for e in gate if e.check == "nll_gain")
    assert sft == {
        "objective": "sft",
        "phase": "post_training.sft",
        "status": "failed",
        "metric": "nll_gain",
        "min": 1e9,
        "value": measured,
        "battery": None,
        "steps": 2,
        "reason": out.reason,
    }
    assert (rlvr["status"], rlvr["metric"], rlvr["value"]) == ("not_run", "reward_gain", None)
    text = readable("status", view)
    assert (
        f"objective gate sft (gate nll_gain {human.score(measured)}, min 1e+09, step 2): FAILED"
        in text
    )
    assert "objective gate rlvr (gate reward_gain, min 0, step 2): not run" in text


@pytest.mark.timeout(600)  # a stage run on Ray: a hang bound for a loaded box
def test_prefix_chain_passes_and_reports_fleet_metrics(
    ray_local: None,
    tmp_path: Path,
    tiny_policy: Path,
    task_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import stages.evals
    from stages.data_prep.config import DataRef
    from stages.post_training.config import ObjectiveBattery
    from stages.post_training.synthetic import write_task

    stage = _stage(tmp_path, tiny_policy, task_files)
    events: list[Any] = []
    # No rlvr gate here: two steps cannot show a trend (the API test gates on it). Its
    # battery runs on the evaluating rank: this process (the driver) scores nothing. Ten
    # prompts, so its held-out split fills a window of the policy's context.
    rl_rows = write_task(tmp_path / "rl-task", rl_numbers=tuple(range(10)))["rlvr"]
    rlvr = stage.config.recipe.rlvr.model_copy(
        update={
            "gate": None,
            "eval": ObjectiveBattery(battery="smoke"),
            "data": DataRef.model_validate(data_ref(rl_rows)),
        }
    )
    stage.config = stage.config.model_copy(
        update={"recipe": stage.config.recipe.model_copy(update={"rlvr": rlvr})}
    )

    def no_battery_here(*a: Any, **kw: Any) -> None:
        raise AssertionError("a battery ran in the driver")

    monkeypatch.setattr(stages.evals, "run_battery", no_battery_here)
    out = stage.run(StageContext(run_id="r", booking_id="b", workdir=tmp_path, emit=events.append))
    assert out.status == "passed", out.reason
    rl_battery = [e for e in events if getattr(e, "scope", "") == "rlvr.battery"]
    assert rl_battery and {"heldout_loss", "arith_mc_acc"} <= set(rl_battery[0].values)
    assert out.artifacts["steps"]["rlvr"]["battery"]["phase"] == "post_training.rlvr"
    assert set(out.artifacts["steps"]) == {"sft", "rlvr"}
    kinds = {(e.kind, getattr(e, "scope", "")) for e in events}
    assert ("metrics", "rlvr") in kinds and ("metrics", "sft") in kinds
    assert out.metrics["rlvr_steps"] == 2.0
    # SFT trained on the engine's replica-group actors, not in this process: its
    # committed steps come from rank 0 of group 0 and its closing checkpoint is DCP.
    sft_steps = [
        e for e in events if e.kind == "step" and e.committed and getattr(e, "phase", "") == "sft"
    ]
    assert [e.step for e in sft_steps] == [1, 2, 3, 4] and all(
        e.stage == "post_training" for e in sft_steps
    )
    assert out.metrics["sft_steps"] == 4.0
    assert any((tmp_path / "sft" / "checkpoints").iterdir())
    # So did the rlvr learner: its steps come from the engine's ranks, its policy is
    # checkpointed by DCP, and each version went from the learner's rank 0 to the fleet
    # (no weights file for the driver to read; no worker missed one).
    rl_steps = [
        e for e in events if e.kind == "step" and e.committed and getattr(e, "phase", "") == "rlvr"
    ]
    assert [e.step for e in rl_steps] == [1, 2]
    assert any((tmp_path / "rlvr" / "checkpoints").iterdir())
    assert not (tmp_path / "rlvr" / "weights").exists()
    # The fleet's metrics of each trained step (step 0 is the whole objective's summary).
    per_step = {
        e.step: e.values
        for e in events
        if e.kind == "metrics" and getattr(e, "scope", "") == "rlvr" and e.step > 0
    }
    assert sorted(per_step) == [1, 2]
    assert per_step[2]["weight_sync_missed"] == 0.0 and per_step[2]["sync_s"] > 0.0
    assert (tmp_path / "out" / "rlvr" / "config.json").is_file()


def test_bad_base_model_and_unknown_reward(
    tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{}")
    out = _stage(tmp_path, not_a_model, task_files).run(
        StageContext(run_id="r", booking_id="b", workdir=tmp_path / "w")
    )
    assert out.error_code == ErrorCode.post_training_model_invalid, out
    bad = _stage(
        tmp_path,
        tiny_policy,
        task_files,
        rlvr={
            "data": data_ref(task_files["rlvr"]),
            "steps": 1,
            "reward": "nope",
            "max_completion_tokens": 4,
            "overlong_buffer_tokens": 1,
        },
    )
    out = bad.run(StageContext(run_id="r", booking_id="b", workdir=tmp_path))
    assert out.error_code == ErrorCode.reward_unknown


def test_validation_time_check_names_the_bad_line(tmp_path: Path, tiny_policy: Path) -> None:
    from stages.post_training.config import PostTrainingConfig
    from stages.post_training.stage import validate_recipe

    good = _write(
        tmp_path,
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
        "s.jsonl",
    )
    bad = _write(tmp_path, [{"prompt": "p", "chosen": "c"}], "p.jsonl")

    def recipe(**kw: Any) -> PostTrainingConfig:
        return PostTrainingConfig.model_validate({**base_model(tiny_policy), **kw})

    def check(r: PostTrainingConfig) -> dict[str, int]:
        return validate_recipe(r, data_roots=DEFAULT_ROOTS, model_roots=DEFAULT_ROOTS)

    assert check(recipe(sft={"data": data_ref(Path(good[7:])), "steps": 1})) == {"sft": 1}
    with pytest.raises(ItoError) as e:
        check(
            recipe(
                sft={"data": data_ref(Path(good[7:])), "steps": 1},
                dpo={"data": data_ref(Path(bad[7:])), "steps": 1},
            )
        )
    assert e.value.code == ErrorCode.post_training_data_invalid and "p.jsonl:1" in str(e.value)
    with pytest.raises(ItoError) as e:  # bytes other than the digest names: refused at plan
        check(recipe(sft={"data": {**data_ref(Path(good[7:])), "sha256": "1" * 64}, "steps": 1}))
    assert e.value.code == ErrorCode.data_digest_mismatch
    with pytest.raises(ItoError) as e:
        check(
            PostTrainingConfig.model_validate(
                {
                    "base_model": f"file://{tmp_path}",
                    "base_model_sha256": "1" * 64,
                    "sft": {"data": data_ref(Path(good[7:])), "steps": 1},
                }
            )
        )
    assert e.value.code == ErrorCode.post_training_model_invalid


def test_the_curriculum_battery_gates_an_objective(
    ray_local: None, tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    """The curriculum's battery (held-out loss + lm-eval checks) and gates after SFT."""
    stage = _stage(
        tmp_path,
        tiny_policy,
        task_files,
        sft={
            "data": data_ref(task_files["sft"]),
            "steps": 2,
            "learning_rate": 5e-3,
            "eval": {
                "battery": "smoke",
                "gates": [
                    {"metric": "heldout_loss", "max": 1e9},
                    {"metric": "arith_mc_acc", "min": 1.01},
                ],
            },
        },
    )
    events: list[Any] = []
    out = stage.run(StageContext(run_id="r", booking_id="b", workdir=tmp_path, emit=events.append))
    assert out.status == "failed" and out.error_code == ErrorCode.eval_gate_failed
    assert "arith_mc_acc" in out.reason and "heldout_loss" not in out.reason
    scores = [e for e in events if getattr(e, "scope", "") == "sft.battery"]
    assert scores and "heldout_loss" in scores[0].values
    checks = {
        (e.battery, e.check): e.passed
        for e in events
        if e.kind == "eval" and e.phase == "post_training.sft"
    }
    assert checks[("objective", "nll_gain")] is True
    assert checks[("smoke", "heldout_loss")] is True
    assert checks[("smoke", "arith_mc_acc")] is False
    assert not (tmp_path / "out" / "rlvr").exists()
    # The run view: the objective's own metric passed, its battery failed it.
    sft = _view(tmp_path, stage, events)["post_training_gates"][0]
    assert (sft["status"], sft["battery"], sft["metric"]) == ("failed", "smoke", "nll_gain")
    assert sft["value"] is not None and sft["value"] >= 0.0
    assert "arith_mc_acc" in sft["reason"]
