"""Ladder probe: the decision rule, and real proxy training on this CPU deciding adopt
for custom data from the eval's domain and reject for noise."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers.fresh_python import run_python

from stages.data_prep.config import LadderProbeConfig
from stages.data_prep.ladder import decide, ladder_probe

REPO = Path(__file__).resolve().parents[2]
# ~60 steps of 8 x 128 bytes per run, 6 runs (baseline shared): seconds on an idle
# 2-core machine. Measured margins: adopt d = -0.154 bpb vs margin 0.027; reject
# d = +0.272 vs 0.093 (deterministic on CPU for fixed seeds).
PROBE = LadderProbeConfig(
    rung_preset="llama-probe-xs", seeds=2, token_budget=60_000, eval_bytes=8_192
)


def _jsonl(path: Path, field: str) -> list[str]:
    return [json.loads(line)[field] for line in path.read_text(encoding="utf-8").splitlines()]


def test_decide_rule() -> None:
    # Clear improvement relative to the seed spread: adopt.
    d, stats = decide([4.10, 4.12], [3.80, 3.83], confidence=0.95, min_effect=0.005)
    assert d == "adopt" and stats["delta_bpb"] == pytest.approx(-0.295)
    # Clear harm: reject.
    assert decide([4.10, 4.12], [4.60, 4.70], 0.95, 0.005)[0] == "reject"
    # A difference inside the seed noise: no decision.
    assert decide([4.10, 4.30], [4.05, 4.28], 0.95, 0.005)[0] == "no_decision"
    # Zero spread cannot make a negligible difference decisive: the floor holds.
    d, stats = decide([4.1, 4.1], [4.099, 4.099], 0.95, 0.005)
    assert d == "no_decision" and stats["margin_bpb"] == 0.005
    with pytest.raises(ValueError):
        decide([4.1], [4.0], 0.95, 0.005)


def test_probe_adopts_in_domain_data_and_rejects_noise() -> None:
    baseline = _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")
    in_domain = _jsonl(REPO / "data" / "gsm8k" / "train.jsonl", "question")[:2000]
    eval_text = _jsonl(REPO / "configs" / "evals" / "gsm8k" / "test.jsonl", "question")
    rng = random.Random(0)
    noise = [
        " ".join(
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
            for _ in range(60)
        )
        for _ in range(2000)
    ]
    adopt = ladder_probe(baseline, in_domain, eval_text, PROBE)
    assert adopt.decision == "adopt", adopt.stats
    assert adopt.tokens_per_run == adopt.steps * 8 * 128 and adopt.seeds == [0, 1]
    assert len(adopt.baseline_bpb) == len(adopt.custom_bpb) == 2
    # The baseline arm does not depend on the custom data: reuse it (checked by digest).
    reject = ladder_probe(baseline, noise, eval_text, PROBE, reuse=adopt)
    assert reject.decision == "reject", reject.stats
    assert reject.baseline_bpb == adopt.baseline_bpb
    assert reject.baseline_sha256 == adopt.baseline_sha256


def test_reuse_refused_when_the_baseline_differs() -> None:
    baseline = _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")[:300]
    eval_text = _jsonl(REPO / "configs" / "evals" / "gsm8k" / "test.jsonl", "question")[:50]
    tiny = LadderProbeConfig(seeds=2, token_budget=2_048, eval_bytes=1_024)
    first = ladder_probe(baseline, baseline[:50], eval_text, tiny)
    logs: list[str] = []
    second = ladder_probe(
        baseline[1:], baseline[:50], eval_text, tiny, reuse=first, log=logs.append
    )
    assert second.baseline_sha256 != first.baseline_sha256
    assert not any("reused" in m for m in logs)
    assert sum("baseline seed" in m for m in logs) == 2  # retrained, both seeds


def test_on_a_run_the_proxies_train_in_ray_tasks_and_score_as_in_process(
    ray_local: None,
) -> None:
    """A run's probe (``ray_runner``: what the stage uses on a booking) trains every
    proxy in a Ray task: the driver process, here a fresh one connected to the
    session's cluster, never imports torch, and the scores equal the in-process
    probe's for the same seeds."""
    import ray

    cfg = LadderProbeConfig(
        rung_preset="llama-probe-xs", seeds=2, token_budget=4096, eval_bytes=2048
    )
    baseline = _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")[:200]
    custom = _jsonl(REPO / "data" / "gsm8k" / "train.jsonl", "question")[:200]
    eval_text = _jsonl(REPO / "configs" / "evals" / "gsm8k" / "test.jsonl", "question")[:50]
    code = (
        "import json, sys, ray\n"
        "from stages.data_prep.config import LadderProbeConfig\n"
        "from stages.data_prep.ladder import ladder_probe\n"
        "from stages.data_prep.ladder_ray import ray_runner\n"
        f"ray.init(address={ray.get_runtime_context().gcs_address!r}, log_to_driver=False)\n"
        "args = json.loads(sys.stdin.read())\n"
        "cfg = LadderProbeConfig.model_validate(args['cfg'])\n"
        "r = ladder_probe(args['b'], args['c'], args['e'], cfg,\n"
        "    run_arms=ray_runner({}, lambda: False))\n"
        "print(json.dumps([r.baseline_bpb, r.custom_bpb, 'torch' in sys.modules]))\n"
    )
    remote_base, remote_custom, driver_imported_torch = run_python(
        code,
        stdin=json.dumps(
            {"cfg": cfg.model_dump(mode="json"), "b": baseline, "c": custom, "e": eval_text}
        ),
    )
    assert driver_imported_torch is False
    local = ladder_probe(baseline, custom, eval_text, cfg)
    # The same seeds, data and CPU kernels; only the thread count may differ.
    assert remote_base == pytest.approx(local.baseline_bpb, abs=1e-3)
    assert remote_custom == pytest.approx(local.custom_bpb, abs=1e-3)


def test_on_cpu_one_task_trains_every_proxy_and_on_cuda_each_has_its_own() -> None:
    """A CPU host is one device: one task process pays the proxies' imports once. On
    CUDA every proxy is a task of its own, each asking a GPU, all at once."""
    from stages.data_prep.ladder import ArmJob
    from stages.data_prep.ladder_ray import task_buckets

    jobs = [ArmJob(arm=a, seed=s, steps=4) for a in ("baseline", "custom") for s in (0, 1)]
    assert task_buckets(jobs, LadderProbeConfig(device="cpu")) == [jobs]
    assert task_buckets(jobs, LadderProbeConfig(device="auto")) == [jobs]
    assert task_buckets(jobs, LadderProbeConfig(device="cuda")) == [[j] for j in jobs]
    assert task_buckets([], LadderProbeConfig()) == []
