"""The curriculum schedule (pure) and the phase data mix (real token shards, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.curriculum.config import CurriculumConfig
from stages.curriculum.schedule import ntk_rope_theta, schedule_curriculum
from stages.errors import ErrorCode, ItoError
from stages.model.tokenizer import ByteTokenizer
from stages.trainer.rank.data import build_token_shards
from stages.trainer.rank.mix import MixedLoader
from stages.trainer.rank.phase_data import split_heldout


def _cur(*phases: dict[str, object]) -> CurriculumConfig:
    return CurriculumConfig.model_validate({"phases": list(phases)}, strict=False)


def _schedule(cur: CurriculumConfig, steps: int = 100):  # type: ignore[no-untyped-def]
    return schedule_curriculum(
        cur,
        total_steps=steps,
        base_seq_len=64,
        global_batch_tokens=1024,
        learning_rate=1e-3,
        warmup_steps=10,
        rope_theta=10000.0,
        head_dim=16,
        max_positions=512,
    )


def test_budgets_seq_lens_schedules_and_rope() -> None:
    schedule = _schedule(
        _cur(
            {"name": "pre", "kind": "pretrain", "token_fraction": 0.6},
            {
                "name": "mid",
                "kind": "mid_train",
                "token_fraction": 0.2,
                "data_weights": {"custom": 4.0},
                "lr_scale": 0.3,
            },
            {"name": "long", "kind": "long_context", "token_fraction": 0.1, "seq_len": 256},
            {"name": "sft", "kind": "post_training", "token_fraction": 0.1},
        )
    )
    pre, mid, long = schedule.phases
    assert schedule.post_training == ["sft"]
    # Trainer phases share the trainer's steps in proportion to their fractions.
    assert [(p.start_step, p.end_step) for p in schedule.phases] == [(0, 67), (67, 89), (89, 100)]
    assert sum(p.token_budget for p in schedule.phases) == 100 * 1024
    assert (pre.seq_len, mid.seq_len, long.seq_len) == (64, 64, 256)
    assert mid.data_weights == {"baseline": 1.0, "custom": 4.0}
    assert long.rope_theta == pytest.approx(ntk_rope_theta(10000.0, 16, 4.0))
    assert long.rope_theta > mid.rope_theta == pre.rope_theta == 10000.0
    # WSD: warmup, a stable peak, then a linear decay to the floor at the phase's end.
    assert pre.lr(0) == pytest.approx(1e-4) and pre.lr(9) == pytest.approx(1e-3)
    assert pre.lr(40) == pytest.approx(1e-3)
    assert pre.lr(66) == pytest.approx(1e-4)
    decay = [pre.lr(s) for s in range(67 - pre.decay_steps, 67)]
    assert decay == sorted(decay, reverse=True) and len(set(decay)) == len(decay)
    assert mid.warmup_steps == 0 and mid.lr(67) == pytest.approx(3e-4)
    assert mid.lr(88) == pytest.approx(3e-5)
    assert (
        schedule.phase_of(66) is pre
        and schedule.phase_of(67) is mid
        and schedule.phase_of(99) is long
    )


@pytest.mark.parametrize(
    "phases",
    [
        [
            {"name": "pre", "kind": "pretrain", "token_fraction": 0.5},
            {"name": "long", "kind": "long_context", "token_fraction": 0.5},
        ],  # same seq_len
        [
            {"name": "pre", "kind": "pretrain", "token_fraction": 0.5, "seq_len": 128},
            {"name": "long", "kind": "long_context", "token_fraction": 0.5, "seq_len": 64},
        ],
        [
            {"name": "pre", "kind": "pretrain", "token_fraction": 0.5},
            {"name": "long", "kind": "long_context", "token_fraction": 0.5, "seq_len": 1024},
        ],
    ],
)
def test_invalid_curricula(phases: list[dict[str, object]]) -> None:
    with pytest.raises(ItoError) as e:
        _schedule(_cur(*phases))
    assert e.value.code == ErrorCode.curriculum_invalid


def test_too_few_steps_for_the_phases() -> None:
    with pytest.raises(ItoError) as e:
        _schedule(
            _cur(
                {"name": "a", "kind": "pretrain", "token_fraction": 0.5},
                {"name": "b", "kind": "mid_train", "token_fraction": 0.5},
            ),
            steps=1,
        )
    assert e.value.code == ErrorCode.curriculum_invalid


def _shards(tmp: Path, role: str, byte: int, n: int = 400) -> list[Path]:
    src = tmp / f"{role}.jsonl"
    src.write_text("".join(json.dumps({"text": chr(byte) * 63}) + "\n" for _ in range(n)))
    return build_token_shards([src], tmp / role, tokenizer=ByteTokenizer())


def test_mix_follows_the_weights_and_seeks_exactly(tmp_path: Path) -> None:
    shards = {
        "baseline": _shards(tmp_path, "baseline", ord("b")),
        "custom": _shards(tmp_path, "custom", ord("c")),
    }
    mix = MixedLoader(
        shards, {"baseline": 1.0, "custom": 3.0}, seq_len=64, micro_batch=4, seed=0, phase="mid"
    )
    batches = [mix.next_batch() for _ in range(50)]
    customs = sum(int((b[:, 1] == ord("c")).sum()) for b in batches)
    # Every row is one role's window (each 64-token doc is one role), 3:1 by weight.
    assert abs(customs - 150) <= 3
    counts = mix.role_counts(200)
    assert counts["custom"] == customs and counts["baseline"] == 200 - customs
    # A fresh loader seeking to batch 37 serves what the first served at 37..49.
    again = MixedLoader(
        shards, {"baseline": 1.0, "custom": 3.0}, seq_len=64, micro_batch=4, seed=0, phase="mid"
    )
    again.seek(37)
    for b in batches[37:]:
        assert again.next_batch().equal(b)
    # Another phase's loader state does not move it; its own does.
    again.load_state_dict({"phase": "pretrain", "batch": 3})
    assert again.batches_served == 50
    again.load_state_dict({"phase": "mid", "batch": 3})
    assert again.batches_served == 3 and again.next_batch().equal(batches[3])
    # A role with no data in the run is skipped; none at all is data_empty.
    only = MixedLoader(
        {"custom": shards["custom"]},
        {"baseline": 1.0, "custom": 1.0},
        seq_len=64,
        micro_batch=2,
        seed=0,
    )
    assert int((only.next_batch()[:, 1] == ord("c")).sum()) == 2
    with pytest.raises(ItoError) as e:
        MixedLoader({}, {"custom": 1.0}, seq_len=64, micro_batch=2, seed=0)
    assert e.value.code == ErrorCode.data_empty


def test_heldout_split_is_deterministic_disjoint_and_bounded(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(1000))
    )
    train, held = split_heldout({"baseline": [src]}, "text", permille=20, min_docs=8)
    assert 8 <= len(held) < 60 and len(held) + len(train["baseline"]) == 1000
    assert not set(held) & set(train["baseline"])
    assert split_heldout({"baseline": [src]}, "text", permille=20, min_docs=8)[1] == held
    _, few = split_heldout({"baseline": [src]}, "text", permille=0, min_docs=8)
    assert len(few) == 8


def test_each_step_is_shared_once_whatever_the_ranks_between_two_steps(tmp_path: Path) -> None:
    """A resize re-cuts the same run-wide stream: at 2, then 3, then 2 data-parallel ranks,
    the shares of each step are exactly the step's batch as one rank reads it whole."""
    shards = {}
    for role in ("baseline", "custom"):
        src = tmp_path / f"{role}.jsonl"
        # Every 64-token window distinct: a sequence read twice or skipped shows.
        src.write_text(
            "".join(
                json.dumps({"text": (f"{role[0]}{i:05d}" * 11)[:63]}) + "\n" for i in range(300)
            )
        )
        shards[role] = build_token_shards([src], tmp_path / role, tokenizer=ByteTokenizer())
    weights = {"baseline": 1.0, "custom": 2.0}
    whole = MixedLoader(shards, weights, seq_len=64, micro_batch=12, seed=5)
    ranks = [
        MixedLoader(shards, weights, seq_len=64, micro_batch=6, seed=5, dp_world=2)
        for _ in range(3)
    ]
    for step in range(30):
        world = 3 if 10 <= step < 20 else 2
        shares = []
        for d, loader in enumerate(ranks[:world]):
            loader.cut(d, world)
            loader.seek(step)
            shares.append(loader.next_batch())
        assert sum(len(s) for s in shares) == 12
        got = sorted(tuple(row.tolist()) for s in shares for row in s)
        assert got == sorted(tuple(row.tolist()) for row in whole.next_batch()), step
    with pytest.raises(ItoError) as e:
        ranks[0].cut(0, 5)  # 12 sequences do not split 5 ways
    assert e.value.code == ErrorCode.resize_refused
