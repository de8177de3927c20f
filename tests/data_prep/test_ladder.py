"""Ladder probe: the decision rule, and real proxy training on this CPU deciding adopt
for custom data from the eval's domain and reject for noise."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
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


def _fleet_engine(tmp: Path) -> Any:
    """A real engine of two replica groups on llama-tiny, its fleet placed and warming
    (as the train stage's prestart leaves it while data prep runs), never given data."""
    from stages.trainer.config import TrainStageConfig
    from stages.trainer.fleet.engine import TrainingEngine
    from stages.trainer.fleet.handoff import Fleet

    cfg = TrainStageConfig.model_validate(
        dict(
            model={"preset": "llama-tiny", "size": "0.1M"},
            target={"max_steps": 4, "seq_len": 32, "global_batch_tokens": 256},
            checkpoint={"interval_steps": 2, "storage_uri": f"file://{tmp}/ckpt"},
            replica_groups=2,
        ),
        strict=False,
    )
    engine = TrainingEngine(
        cfg,
        run_id="probe-ranks",
        checkpoint_dir=tmp / "ckpt",
        role_shards=None,
        emit=lambda _e: None,
        cancel_event=threading.Event(),
        wait_decision=lambda _p, _t: None,
        fleet=Fleet(tmp / "fleet"),
    )
    engine.start_in_background()
    return engine


def test_a_runs_proxies_train_on_its_warm_ranks_and_score_as_in_process(
    ray_local: None, tmp_path: Path
) -> None:
    """A run's probe borrows the trainer ranks placed while data prep runs (their
    devices are the booking's): the proxies are dealt over both replica groups' ranks,
    a proxy in training holds up none of the driver's calls to its rank, and the
    scores equal the in-process probe's for the same seeds."""
    import ray

    from stages.data_prep.ladder_ranks import rank_runner, train_proxy
    from stages.trainer.rank.replica import BORROWED_GROUP

    cfg = LadderProbeConfig(
        rung_preset="llama-probe-xs", seeds=2, token_budget=4096, eval_bytes=2048
    )
    baseline = _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")[:200]
    custom = _jsonl(REPO / "data" / "gsm8k" / "train.jsonl", "question")[:200]
    eval_text = _jsonl(REPO / "configs" / "evals" / "gsm8k" / "test.jsonl", "question")[:50]
    engine = _fleet_engine(tmp_path)
    try:
        ranks = engine.fleet.placed_ranks(120.0)
        assert sorted(ranks) == [(0, 0), (1, 0)], engine.launcher.start_error
        remote = ladder_probe(
            baseline, custom, eval_text, cfg, run_arms=rank_runner(engine.fleet, lambda: False)
        )
        assert remote.trained_on == ["rg0/rank0", "rg1/rank0"]
        # A long proxy in training: the rank still answers the driver's poll first.
        from stages.data_prep.ladder import ArmJob

        rank = ranks[(0, 0)]
        stream = ray.put(np.arange(20_000, dtype=np.int64) % 200)
        windows = ray.put(np.zeros((4, 128), dtype=np.int64))
        long = rank.run_borrowed.options(concurrency_group=BORROWED_GROUP).remote(
            train_proxy, ArmJob("baseline", 0, 400), stream, windows, cfg
        )
        poll = rank.poll.remote()
        first, _ = ray.wait([long, poll], num_returns=1, timeout=300)
        assert first == [poll], "the proxy held up the driver's poll"
        ray.get(long, timeout=300)
    finally:
        engine.shutdown()
    local = ladder_probe(baseline, custom, eval_text, cfg)
    assert local.trained_on == ["in-process"]
    # The same seeds, data and CPU kernels; only the thread count may differ.
    assert remote.baseline_bpb == pytest.approx(local.baseline_bpb, abs=1e-3)
    assert remote.custom_bpb == pytest.approx(local.custom_bpb, abs=1e-3)


def test_a_free_rank_takes_the_next_proxy() -> None:
    """One proxy to each rank at first (both arms at once on two ranks), then the next
    to whichever rank finished first: a rank slowed by its own warm-up (its model build
    beside its first proxy) must not hold a proxy a free rank could train."""
    from stages.data_prep.ladder import ArmJob
    from stages.data_prep.ladder_ranks import Dealer

    jobs = [ArmJob(arm=a, seed=s, steps=4) for s in (0, 1) for a in ("baseline", "custom")]
    dealer = Dealer(jobs, 2)
    assert dealer.first() == [(0, jobs[0]), (1, jobs[1])]
    # Rank 1 is done twice before rank 0 once: it trains the third and the fourth.
    assert dealer.next_for(1) == jobs[2]
    assert dealer.next_for(1) == jobs[3]
    assert dealer.next_for(0) is None
    assert Dealer(jobs, 8).first() == list(enumerate(jobs))  # a rank per proxy, the rest idle
    assert Dealer([], 2).first() == []
