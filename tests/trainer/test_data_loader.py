"""Token shards and the resumable TokenLoader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.errors import ErrorCode, ItoError
from stages.model.tokenizer import ByteTokenizer
from stages.trainer.rank.data import (
    INDEX_NAME,
    TokenLoader,
    build_token_shards,
    read_token_index,
)

TOK = ByteTokenizer()


def _inputs(tmp: Path) -> list[Path]:
    jl = tmp / "a.jsonl"
    jl.write_text(
        "\n".join(json.dumps({"text": f"document number {i} " * (i % 5 + 1)}) for i in range(40))
        + "\n"
    )
    pa_path = tmp / "b.parquet"
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(30)]}), pa_path)
    txt = tmp / "c.txt"
    txt.write_text("plain text file, one document.\n" * 20)
    return [jl, pa_path, txt]


def test_shards_are_deterministic_and_lossless(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path)
    a = build_token_shards(inputs, tmp_path / "s1", tokenizer=TOK, shard_tokens=500)
    b = build_token_shards(inputs, tmp_path / "s2", tokenizer=TOK, shard_tokens=500)
    assert len(a) > 2
    for x, y in zip(a, b, strict=True):
        assert x.read_bytes() == y.read_bytes()
    index_bytes = (tmp_path / "s1" / INDEX_NAME).read_bytes()
    assert index_bytes == (tmp_path / "s2" / INDEX_NAME).read_bytes()

    tokens = np.concatenate([np.load(p) for p in a]).tolist()
    expected: list[int] = []
    for i in range(40):
        expected += TOK.encode(f"document number {i} " * (i % 5 + 1))
    for i in range(30):
        expected += TOK.encode(f"parquet row {i}")
    expected += TOK.encode("plain text file, one document.\n" * 20)
    assert tokens == expected
    index = json.loads((tmp_path / "s1" / INDEX_NAME).read_text())
    assert index["total_tokens"] == len(expected)
    assert index["documents"] == 71
    assert [s["tokens"] for s in index["shards"][:-1]] == [500] * (len(a) - 1)
    assert read_token_index(tmp_path / "s1", verify=True) == a


def test_index_detects_tampering_and_bad_inputs(tmp_path: Path) -> None:
    shards = build_token_shards(_inputs(tmp_path), tmp_path / "s", tokenizer=TOK, shard_tokens=500)
    data = bytearray(shards[1].read_bytes())
    data[-1] ^= 1
    shards[1].write_bytes(bytes(data))
    with pytest.raises(ItoError) as e:
        read_token_index(tmp_path / "s", verify=True)
    assert e.value.code == ErrorCode.data_digest_mismatch

    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n")
    with pytest.raises(ItoError) as e:
        build_token_shards([bad], tmp_path / "o", tokenizer=TOK)
    assert e.value.code == ErrorCode.data_format_unsupported
    with pytest.raises(ItoError) as e:
        build_token_shards([tmp_path / "missing.jsonl"], tmp_path / "o", tokenizer=TOK)
    assert e.value.code == ErrorCode.data_not_found
    nofield = tmp_path / "n.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(ItoError) as e:
        build_token_shards([nofield], tmp_path / "o", tokenizer=TOK)
    assert e.value.code == ErrorCode.data_format_unsupported


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    return build_token_shards(
        _inputs(tmp_path), tmp_path / "shards", tokenizer=TOK, shard_tokens=333
    )


def _take(loader: TokenLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(n)]


@pytest.fixture
def counting_shards(tmp_path: Path) -> list[Path]:
    """Shards whose tokens are 0, 1, 2, ...: a row's first token names its window."""
    out = []
    for i, n in enumerate((1000, 37, 1203)):
        start = sum((1000, 37, 1203)[:i])
        p = tmp_path / f"count_{i}.npy"
        np.save(p, np.arange(start, start + n, dtype=np.int32))
        out.append(p)
    return out


def test_batches_are_windows_and_each_epoch_is_a_permutation(counting_shards: list[Path]) -> None:
    loader = TokenLoader(counting_shards, seq_len=16, micro_batch=4, seed=3)
    assert loader.num_windows == 2240 // 16
    windows = []
    for batch in _take(loader, loader.batches_per_epoch):
        assert batch.dtype == torch.long and batch.shape == (4, 16)
        for row in batch:
            w = int(row[0]) // 16
            assert int(row[0]) == w * 16  # aligned, and spans shard boundaries intact
            assert torch.equal(row, torch.arange(w * 16, w * 16 + 16))
            windows.append(w)
    assert len(set(windows)) == len(windows) == loader.batches_per_epoch * 4
    assert windows != sorted(windows)  # shuffled
    assert loader.epoch == 1 and loader.batch_in_epoch == 0
    epoch1 = [int(r[0]) // 16 for r in loader.next_batch()]
    assert epoch1 != windows[:4]  # a new order each epoch
    again = TokenLoader(counting_shards, seq_len=16, micro_batch=4, seed=3)
    again.skip(again.batches_per_epoch)
    assert [int(r[0]) // 16 for r in again.next_batch()] == epoch1


def test_seed_changes_order(shards: list[Path]) -> None:
    a = TokenLoader(shards, seq_len=16, micro_batch=4, seed=0).next_batch()
    b = TokenLoader(shards, seq_len=16, micro_batch=4, seed=1).next_batch()
    assert not torch.equal(a, b)


def test_dp_ranks_are_disjoint(counting_shards: list[Path]) -> None:
    per_rank: list[set[int]] = []
    for r in range(3):
        ld = TokenLoader(counting_shards, seq_len=16, micro_batch=2, seed=7, dp_rank=r, dp_world=3)
        got = [int(row[0]) // 16 for b in _take(ld, ld.batches_per_epoch) for row in b]
        assert len(set(got)) == len(got) == ld.batches_per_epoch * 2
        per_rank.append(set(got))
    assert not per_rank[0] & per_rank[1]
    assert not per_rank[0] & per_rank[2]
    assert not per_rank[1] & per_rank[2]


def test_resume_at_the_exact_sample(shards: list[Path]) -> None:
    ref = TokenLoader(shards, seq_len=16, micro_batch=4, seed=11)
    expected = _take(ref, ref.batches_per_epoch + 5)  # crosses an epoch boundary

    for cut in (0, 1, 7, ref.batches_per_epoch - 1, ref.batches_per_epoch + 2):
        first = TokenLoader(shards, seq_len=16, micro_batch=4, seed=11)
        _take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
        resumed = TokenLoader(shards, seq_len=16, micro_batch=4, seed=11)
        resumed.load_state_dict(state)
        for i, batch in enumerate(_take(resumed, len(expected) - cut)):
            assert torch.equal(batch, expected[cut + i]), f"cut {cut}, batch {i}"


def test_skip_equals_reading(shards: list[Path]) -> None:
    a = TokenLoader(shards, seq_len=16, micro_batch=4, seed=5)
    b = TokenLoader(shards, seq_len=16, micro_batch=4, seed=5)
    _take(a, 9)
    b.skip(9)
    assert torch.equal(a.next_batch(), b.next_batch())
    assert a.state_dict() == b.state_dict()


def test_peer_state_loads_on_another_rank_but_other_data_is_refused(shards: list[Path]) -> None:
    r0 = TokenLoader(shards, seq_len=16, micro_batch=2, seed=7, dp_rank=0, dp_world=2)
    r1 = TokenLoader(shards, seq_len=16, micro_batch=2, seed=7, dp_rank=1, dp_world=2)
    _take(r0, 4)
    r1.load_state_dict(r0.state_dict())
    assert r1.batches_served == 4
    other = TokenLoader(shards, seq_len=8, micro_batch=2, seed=7)
    with pytest.raises(ItoError) as e:
        other.load_state_dict(r0.state_dict())
    assert e.value.code == ErrorCode.checkpoint_corrupt


def test_too_little_data_is_refused(shards: list[Path]) -> None:
    with pytest.raises(ItoError) as e:
        TokenLoader(shards[-1:], seq_len=200, micro_batch=64, seed=0)
    assert e.value.code == ErrorCode.data_empty


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seq_len=st.integers(2, 40),
    micro_batch=st.integers(1, 6),
    dp_world=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    cut=st.integers(0, 60),
    skip=st.integers(0, 30),
)
def test_resume_and_skip_property(
    counting_shards: list[Path],
    seq_len: int,
    micro_batch: int,
    dp_world: int,
    seed: int,
    cut: int,
    skip: int,
) -> None:
    """For any shape: (read cut, save, load, skip) serves what reading straight through does."""
    kw = {
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "seed": seed,
        "dp_world": dp_world,
        "dp_rank": dp_world - 1,
    }
    ref = TokenLoader(counting_shards, **kw)
    expected = _take(ref, cut + skip + 3)[cut + skip :]
    first = TokenLoader(counting_shards, **kw)
    _take(first, cut)
    resumed = TokenLoader(counting_shards, **kw)
    resumed.load_state_dict(first.state_dict())
    resumed.skip(skip)
    for want in expected:
        assert torch.equal(resumed.next_batch(), want)


def test_a_one_role_mix_reads_exactly_what_a_plain_loader_reads(
    counting_shards: list[Path],
) -> None:
    """A run without a curriculum trains through MixedLoader: with one role it serves
    the plain TokenLoader's batches, in order, through the first epoch and after a
    seek (later epochs wrap at the window, not the batch: no partial batch is lost)."""
    from stages.trainer.rank.mix import MixedLoader

    kw = dict(seq_len=16, micro_batch=4, seed=3, dp_rank=1, dp_world=2)
    plain = TokenLoader(counting_shards, **kw)  # type: ignore[arg-type]
    mix = MixedLoader({"baseline": counting_shards}, {"baseline": 1.0, "custom": 1.0}, **kw)  # type: ignore[arg-type]
    for _ in range(plain.batches_per_epoch):
        assert torch.equal(plain.next_batch(), mix.next_batch())
    again = MixedLoader({"baseline": counting_shards}, {"baseline": 1.0}, **kw)  # type: ignore[arg-type]
    again.seek(5)
    plain._seek(5)
    assert torch.equal(plain.next_batch(), again.next_batch())
