"""Ladder probe: the decision rule, and real proxy training on this CPU deciding adopt
for custom data from the eval's domain and reject for noise."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

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
