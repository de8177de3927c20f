"""Eval batteries through the real lm-evaluation-harness (offline, vendored files)
and the gate decision. A tiny random-init model: the numbers are real but small."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers.fresh_python import run_python
from helpers.xdist_groups import module_group

from stages.data_prep.evals import list_eval_suites, load_eval_items, load_eval_suite
from stages.errors import ErrorCode, ItoError
from stages.evals import (
    BatteryResult,
    CheckResult,
    EvalSettings,
    GateThreshold,
    evaluate_gates,
    list_batteries,
    load_battery,
    run_battery,
)
from stages.hf import train_tokenizer
from stages.model.lm import build_model
from stages.presets import configs_dir, load_model_preset

pytestmark = module_group(__name__)

HELDOUT = [f"def f{i}(x):\n    return x + {i}  # add\n" for i in range(120)]


@pytest.fixture(scope="module")
def lm() -> tuple[Any, Any]:
    model = build_model(load_model_preset("llama-tiny"), seed=0)
    return model, train_tokenizer([], vocab_size=260, model_max_length=256)


@pytest.fixture(scope="module")
def first(lm: tuple[Any, Any]) -> BatteryResult:
    model, tok = lm
    return run_battery(model, tok, "smoke", HELDOUT, seq_len=64, phase="pretrain", step=10)


def test_smoke_battery_runs_every_check_through_lm_eval(first: BatteryResult) -> None:
    assert [c.name for c in first.checks] == load_battery("smoke").check_names
    assert all(c.status == "ok" for c in first.checks), first.checks
    s = first.scores()
    assert 0.0 <= s["gsm8k_exact_match"] <= 1.0 and 0.0 <= s["arith_mc_acc"] <= 1.0
    # 12 items with 4 choices: acc is a multiple of 1/12, as lm-eval's mean gives it.
    assert abs(s["arith_mc_acc"] * 12 - round(s["arith_mc_acc"] * 12)) < 1e-9
    # A random-init byte model is near uniform over 260 ids: ~ln(260) nats a token.
    assert 4.5 < s["heldout_loss"] < 6.5
    # Byte vocabulary: one byte a token except the EOS closing each ~33-byte text, which
    # costs nats but stands for no byte.
    per_token_bits = s["heldout_loss"] / 0.693147
    assert per_token_bits < s["heldout_bits_per_byte"] < per_token_bits * 34 / 32
    # Every file the numbers depend on is pinned by sha256.
    root = configs_dir() / "evals"
    assert set(first.task_files) == {
        "smoke.json",
        "smoke/ito_smoke_gsm8k.yaml",
        "smoke/gsm8k_mini.jsonl",
        "smoke/gsm8k_fewshot.jsonl",
        "smoke/ito_smoke_mc.yaml",
        "smoke/arith_mc.jsonl",
    }
    import hashlib

    assert (
        first.task_files["smoke/arith_mc.jsonl"]
        == hashlib.sha256((root / "smoke/arith_mc.jsonl").read_bytes()).hexdigest()
    )


def test_the_same_checkpoint_scores_identically_twice(
    lm: tuple[Any, Any], first: BatteryResult
) -> None:
    model, tok = lm
    again = run_battery(model, tok, "smoke", HELDOUT, seq_len=64, phase="pretrain", step=10)
    assert again.scores() == first.scores()
    assert again.task_files == first.task_files


def test_gate_bounds_and_regression(first: BatteryResult) -> None:
    loss = first.scores()["heldout_loss"]
    ok = evaluate_gates(
        first,
        [
            GateThreshold(metric="heldout_loss", max=loss + 1),
            GateThreshold(metric="arith_mc_acc", min=0.0),
        ],
    )
    assert ok.passed and not ok.failing
    bad = evaluate_gates(first, [GateThreshold(metric="heldout_loss", max=loss - 0.5)])
    assert not bad.passed
    [v] = bad.failing
    assert v.check == "heldout_loss" and v.score == loss and v.max == loss - 0.5
    assert "above max" in v.reason and v.phase == "pretrain"
    # Regression: loss is lower-is-better, so a previous loss 0.2 lower is a regression.
    prev = first.model_copy(
        update={
            "checks": [
                c.model_copy(update={"score": c.score - 0.2}) if c.name == "heldout_loss" else c
                for c in first.checks
            ]
        }
    )
    t = [GateThreshold(metric="heldout_loss", max_regression=0.1)]
    reg = evaluate_gates(first, t, previous=prev)
    assert not reg.passed and reg.failing[0].previous == pytest.approx(loss - 0.2)
    assert evaluate_gates(
        first, [GateThreshold(metric="heldout_loss", max_regression=0.3)], previous=prev
    ).passed
    # No previous result (first phase): the regression bound has nothing to compare.
    assert evaluate_gates(first, t).passed
    # A threshold on a check the battery does not have is a failure, never ignored.
    assert not evaluate_gates(first, [GateThreshold(metric="mmlu_acc", min=0.1)]).passed
    # The battery's files changed between phases: fail.
    moved = first.model_copy(update={"task_files": {**first.task_files, "smoke.json": "0"}})
    assert not evaluate_gates(first, [], previous=moved).passed


def test_crash_timeout_or_no_number_fail_even_without_a_bound(first: BatteryResult) -> None:
    for status in ("error", "timeout", "no_number"):
        checks = [
            c.model_copy(update={"status": status, "score": None, "error": "x"})
            if c.name == "gsm8k_exact_match"
            else c
            for c in first.checks
        ]
        d = evaluate_gates(first.model_copy(update={"checks": checks}), [])
        assert not d.passed and [v.check for v in d.failing] == ["gsm8k_exact_match"]
        assert d.failing[0].reason.startswith(status)
    assert isinstance(first.checks[0], CheckResult)


def test_a_real_timeout_is_a_failed_gate(lm: tuple[Any, Any]) -> None:
    model, tok = lm
    r = run_battery(
        model, tok, "smoke", HELDOUT, seq_len=64, settings=EvalSettings(check_timeout_s=1e-4)
    )
    assert {c.status for c in r.checks} == {"timeout"} and not r.scores()
    assert not evaluate_gates(r, []).passed


def test_an_eval_that_raises_is_a_failed_gate(
    lm: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A battery whose multiple-choice data is not JSON: lm-eval (datasets) raises for
    real inside that check; the other checks still run and score."""
    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    (cfg / "evals" / "smoke" / "arith_mc.jsonl").write_text("{not json\n")
    monkeypatch.setenv("ITO_CONFIGS_DIR", str(cfg))
    model, tok = lm
    r = run_battery(model, tok, "smoke", HELDOUT, seq_len=64, phase="mid_train")
    by = {c.name: c for c in r.checks}
    assert by["arith_mc_acc"].status == "error" and by["arith_mc_acc"].score is None
    assert by["heldout_loss"].status == "ok" and by["gsm8k_exact_match"].status == "ok"
    d = evaluate_gates(r, [GateThreshold(metric="heldout_loss", max=100)])
    assert not d.passed and [v.check for v in d.failing] == ["arith_mc_acc"]
    # And a heldout split too small for one window raises in the heldout check.
    r2 = run_battery(model, tok, "smoke", ["tiny"], seq_len=64)
    assert {c.status for c in r2.checks if c.kind == "heldout"} == {"error"}


def test_battery_registry(tmp_path: Path) -> None:
    assert "smoke" in list_batteries() and "gsm8k" not in list_batteries()
    with pytest.raises(ItoError) as e:
        load_battery("nope")
    assert e.value.code == ErrorCode.eval_battery_unknown
    with pytest.raises(ItoError) as e:
        load_battery("gsm8k")  # an eval suite without checks is not a battery
    assert e.value.code == ErrorCode.eval_battery_unknown
    # A battery is also an eval suite: decontamination reads its items.
    items, _infos = load_eval_items(["smoke"])
    assert len(items) == 8 + 12 and {i.suite for i in items} == {"smoke"}
    assert json.loads((configs_dir() / "evals" / "smoke.json").read_text())["checks"]
    # The held-out battery names no item file: a battery, but no eval suite.
    assert "heldout" in list_batteries() and "heldout" not in list_eval_suites()
    with pytest.raises(ItoError) as e:
        load_eval_suite("heldout")
    assert e.value.code == ErrorCode.eval_suite_unknown


def test_a_heldout_only_battery_scores_without_lm_eval() -> None:
    """The held-out battery gates on held-out loss and bits per byte alone: a rank that
    runs it neither preloads lm-evaluation-harness nor imports it at the phase end."""
    from stages.trainer.phase_eval import battery_runs_lm_eval

    assert battery_runs_lm_eval("smoke") and not battery_runs_lm_eval("heldout")
    assert not battery_runs_lm_eval(None)
    out = run_python(
        "import json, sys\n"
        "from stages.evals import run_battery\n"
        "from stages.hf import train_tokenizer\n"
        "from stages.model.lm import build_model\n"
        "from stages.presets import load_model_preset\n"
        "model = build_model(load_model_preset('llama-tiny'), seed=0)\n"
        "tok = train_tokenizer([], vocab_size=260, model_max_length=256)\n"
        f"r = run_battery(model, tok, 'heldout', {HELDOUT!r}, seq_len=64)\n"
        "print(json.dumps({'checks': [[c.name, c.status] for c in r.checks],"
        " 'lm_eval': 'lm_eval' in sys.modules}))\n"
    )
    assert out == {
        "checks": [["heldout_loss", "ok"], ["heldout_bits_per_byte", "ok"]],
        "lm_eval": False,
    }


def test_heldout_shares_of_the_data_parallel_ranks_reduce_to_the_one_rank_score(
    lm: tuple[Any, Any],
) -> None:
    """Each rank scores every ``parts``-th batch; the reduced sums (after the JSON trip
    they make from the ranks to the driver) give exactly the one-rank score."""
    from stages.evals.heldout import HeldoutSums, heldout_scores, heldout_sums, reduce_sums

    model, tok = lm
    one = heldout_scores(model, tok, HELDOUT, seq_len=64, batch_size=2)
    whole = heldout_sums(model, tok, HELDOUT, seq_len=64, batch_size=2)
    assert len(whole.batch_nats) > 3
    for parts in (2, 3):
        shares = [
            HeldoutSums.model_validate(
                json.loads(
                    heldout_sums(
                        model, tok, HELDOUT, seq_len=64, batch_size=2, part=p, parts=parts
                    ).model_dump_json()
                )
            )
            for p in range(parts)
        ]
        assert all(0 < len(s.batch_nats) < len(whole.batch_nats) for s in shares)
        total = reduce_sums(shares)
        assert sorted(total.batch_nats) == sorted(whole.batch_nats)
        assert total.tokens == whole.tokens and total.bytes == whole.bytes
        assert total.scores() == one
    # A batch counted twice (a rank's share added again) is refused, not averaged in.
    with pytest.raises(ValueError):
        reduce_sums([shares[0], shares[0]])


def test_run_tasks_scores_what_lm_evals_simple_evaluate_scores(
    lm: tuple[Any, Any], tmp_path: Path
) -> None:
    """``run_tasks`` calls lm-eval's ``evaluate`` with ``simple_evaluate``'s seeding and
    task set-up (without its host report) on the repo's Llama: every metric must come
    out as ``simple_evaluate`` scores transformers' own model of the same weights."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    from stages.evals.config import evals_dir
    from stages.evals.harness import materialise, run_tasks
    from stages.hf import export_hf

    model, tok = lm
    yamls = [evals_dir() / "smoke/ito_smoke_mc.yaml", evals_dir() / "smoke/ito_smoke_gsm8k.yaml"]
    ours = run_tasks(
        model, tok, yamls, include_dir=tmp_path / "ours", max_length=64, limit=6, seed=3
    )
    names = [materialise(t, tmp_path / "ref") for t in yamls]
    hf = AutoModelForCausalLM.from_pretrained(
        str(export_hf(model, tok, tmp_path / "hf")), local_files_only=True
    ).eval()
    ref = lm_eval.simple_evaluate(
        model=HFLM(pretrained=hf, tokenizer=tok, device="cpu", batch_size=8, max_length=64),
        tasks=names,
        limit=6,
        log_samples=False,
        bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(tmp_path / "ref"), include_defaults=False),
        random_seed=3,
        numpy_random_seed=3,
        torch_random_seed=3,
        fewshot_random_seed=3,
    )
    model.train()
    assert ref is not None
    expected = {
        task: {k: float(v) for k, v in m.items() if isinstance(v, int | float) and k != "samples"}
        for task, m in ref["results"].items()
    }
    assert set(ours) == set(names)
    assert ours == expected, (ours, expected)
