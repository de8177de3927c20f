"""Checkpointer in one process: exact resume, commit-on-complete, keep-K, failures."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.checkpointing import (
    COMMIT_NAME,
    Checkpointer,
    CheckpointPolicy,
    CheckpointRecord,
    delete_checkpoint,
    list_checkpoints,
    storage_usage,
    sweep_incomplete,
)
from stages.checkpointing.seal import SEAL_NAME
from stages.checkpointing.storage import READ_LOG_NAME, read_log
from stages.errors import ErrorCode, ItoError
from stages.events import CheckpointEvent
from stages.trainer.rank.train_state import TrainState, set_determinism

Tiny = Any  # the ``tiny`` fixture of conftest.py: a real training loop
COMMIT_HOLD_TIMEOUT_S = 60.0


@pytest.mark.parametrize("async_staging", [False, True])
def test_resume_from_async_checkpoint_is_step_for_step_identical(
    tiny: Tiny, policy: Callable[..., CheckpointPolicy], async_staging: bool
) -> None:
    set_determinism(tiny.seed)
    reference = tiny.train(tiny.state(), 10)

    # Saves at steps 3 and 6 while training goes on and mutates the weights.
    set_determinism(tiny.seed)
    with Checkpointer(policy(interval_steps=3), async_staging=async_staging) as ck:
        state = tiny.state()

        def between(s: TrainState) -> None:
            if ck.due(s.step):
                ck.save(s.step, s)  # the next optimizer.step() waits for the copy

        first = tiny.train(state, 8, between)
        ck.wait()
        assert first == reference[:8]
        records = ck.records()
        assert [r.step for r in records] == [3, 6]

    set_determinism(tiny.seed + 1)  # another process: other weights, other RNG
    with Checkpointer(policy(interval_steps=3)) as ck:
        resumed = tiny.state(model_seed=tiny.seed + 1)
        latest = ck.latest()
        assert latest is not None and latest.step == 6
        ck.load(latest, resumed)
        assert resumed.step == 6
        assert tiny.train(resumed, 4) == reference[6:10]


def _hold_staging(ck: Checkpointer, release: threading.Event) -> None:
    """Make the background copy wait for ``release`` (only decides *when* it runs)."""
    real_stage = ck._stager._stage

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(COMMIT_HOLD_TIMEOUT_S)
        return real_stage(*args, **kwargs)

    ck._stager._stage = held  # type: ignore[method-assign]


def test_background_copy_is_guarded_by_the_optimizer_step(
    tiny: Tiny, policy: Callable[..., CheckpointPolicy]
) -> None:
    set_determinism(tiny.seed)
    state = tiny.state()
    tiny.train(state, 2)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    with Checkpointer(policy(), async_staging=True) as ck:
        release = threading.Event()
        _hold_staging(ck, release)
        ck.save(2, state)  # returns while the copy has not even started
        threading.Timer(0.2, release.set).start()
        tiny.train(state, 1)  # its optimizer.step() waits for the copy
        record = ck.wait()
    assert record is not None
    assert not torch.equal(state.model.state_dict()["lm_head.weight"], before["lm_head.weight"])
    restored = tiny.state(model_seed=tiny.seed + 5)
    with Checkpointer(policy()) as ck:
        ck.load(record, restored)
    for k, v in restored.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_state_without_optimizer_is_copied_before_save_returns(
    policy: Callable[..., CheckpointPolicy],
) -> None:
    state = {"w": torch.zeros(1000)}
    with Checkpointer(policy(), async_staging=True) as ck:
        release = threading.Event()
        _hold_staging(ck, release)
        threading.Timer(0.2, release.set).start()
        ck.save(2, state)
        state["w"].fill_(7)  # mutated right after save returns
        record = ck.wait()
        assert record is not None
        ck.load(record, state)
    assert torch.equal(state["w"], torch.zeros(1000))


def test_records_are_complete_and_become_events(
    tiny: Tiny, policy: Callable[..., CheckpointPolicy]
) -> None:
    set_determinism(tiny.seed)
    with Checkpointer(policy(interval_steps=2), run_label="run-1") as ck:
        state = tiny.state()
        tiny.train(state, 2)
        ck.save(2, state)
        record = ck.wait()
        assert record is not None
        assert ck.poll() == [record]
        assert ck.poll() == []  # each completion is reported once
    path = Path(record.path)
    assert path.name == "step_000000002" and (path / COMMIT_NAME).is_file()
    on_disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    # The record counts the bytes DCP wrote: not its own commit file, nor the seal.
    records = (path / COMMIT_NAME).stat().st_size + (path / SEAL_NAME).stat().st_size
    assert record.bytes == on_disk - records
    n_params = sum(p.numel() for p in state.model.parameters())
    assert record.bytes > 3 * 4 * n_params  # weights + two AdamW moments, fp32
    assert 0 < record.blocking_s <= record.total_s
    assert record.bytes_per_s == pytest.approx(record.bytes / record.total_s)
    assert record.run_label == "run-1"
    assert list_checkpoints(path.parent) == [record]
    assert list_checkpoints(f"file://{path.parent}") == [record]  # a policy's storage_uri
    event = record.to_event()
    assert isinstance(event, CheckpointEvent) and event.bytes == record.bytes
    assert storage_usage(path.parent) == {"complete_bytes": record.bytes, "leftover_bytes": 0}


def test_keep_last_k(policy: Callable[..., CheckpointPolicy]) -> None:
    state = {"w": torch.zeros(1000)}
    with Checkpointer(policy(keep=2)) as ck:
        expected = {2: [2], 4: [2, 4], 6: [4, 6], 8: [6, 8]}
        for step in (2, 4, 6, 8):
            state["w"].fill_(step)
            ck.save(step, state)
            ck.wait()
            assert [r.step for r in ck.records()] == expected[step]
        storage = ck.storage_dir
        ck.load(ck.records()[0], state)
        assert torch.equal(state["w"], torch.full((1000,), 6.0))
    # Only complete checkpoints are left, and the storage's ledger of the one load.
    assert sorted(p.name for p in storage.iterdir()) == [
        READ_LOG_NAME,
        "step_000000006",
        "step_000000008",
    ]
    assert [r.step for r in read_log(storage)] == [6]


@pytest.mark.parametrize("async_staging", [False, True])
def test_a_stager_closed_by_its_last_save_is_replaced(
    policy: Callable[..., CheckpointPolicy], async_staging: bool
) -> None:
    # torch before 2.12 closes the StateDictStager after every stage (its copy
    # dispatch emptied): a reused stager then failed the next save with
    # "KeyError: <class 'type'>". Close it as those versions do, and save again.
    state = {"w": torch.zeros(16), "step": 0}
    with Checkpointer(policy(), async_staging=async_staging) as ck:
        for step in (1, 2, 3):
            state["w"].fill_(step)
            ck.save(step, state)
            assert ck.wait() is not None
            ck._stager._state_dict_stager.close()  # what torch 2.11's _stage does
        loaded = {"w": torch.zeros(16), "step": 0}
        ck.load(ck.records()[-1], loaded)
    assert torch.equal(loaded["w"], torch.full((16,), 3.0))


def test_a_save_launches_at_the_short_switch_interval_and_restores_it(
    policy: Callable[..., CheckpointPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launch hands the GIL to the staging and upload threads it wakes: at the
    # default interval each hand-back costs the caller up to 5 ms. The real async_save
    # runs; the spy only reads the interval it runs at.
    import sys

    import stages.checkpointing.checkpointer as checkpointer_mod

    seen: list[float] = []
    real_async_save = checkpointer_mod.state_dict_saver.async_save

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(sys.getswitchinterval())
        return real_async_save(*args, **kwargs)

    monkeypatch.setattr(checkpointer_mod.state_dict_saver, "async_save", spy)
    before = sys.getswitchinterval()
    state = {"w": torch.zeros(1000)}
    with Checkpointer(policy()) as ck:
        ck.save(1, state)
        assert ck.wait() is not None
    assert seen == [pytest.approx(checkpointer_mod.LAUNCH_SWITCH_INTERVAL_S)]
    assert sys.getswitchinterval() == before


def test_an_older_checkpoint_survives_until_the_newer_one_is_complete(
    policy: Callable[..., CheckpointPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.checkpointing.checkpointer as checkpointer_mod

    release = threading.Event()
    real_commit = checkpointer_mod.commit

    def held_commit(*args: Any, **kwargs: Any) -> CheckpointRecord:
        assert release.wait(COMMIT_HOLD_TIMEOUT_S)
        return real_commit(*args, **kwargs)

    state = {"w": torch.zeros(1000)}
    with Checkpointer(policy(keep=1)) as ck:
        ck.save(2, state)
        ck.wait()
        monkeypatch.setattr(checkpointer_mod, "commit", held_commit)
        ck.save(4, state)
        # Step 4's data is written but not committed: step 2 is still the one listed.
        assert [r.step for r in ck.records()] == [2]
        assert ck.poll() == [ck.records()[0]]  # only step 2's completion so far
        release.set()
        rec = ck.wait()
        assert rec is not None and rec.step == 4
        assert [r.step for r in ck.records()] == [4]


def test_discard_after_restart_point(policy: Callable[..., CheckpointPolicy]) -> None:
    state = {"w": torch.zeros(10)}
    with Checkpointer(policy(keep=5)) as ck:
        for step in (2, 4, 6):
            ck.save(step, state)
        ck.wait()
        gone = ck.discard_after(2)
        assert [r.step for r in gone] == [4, 6]
        assert [r.step for r in ck.records()] == [2]
        # Re-saving a step that already exists (a replayed timeline) replaces it.
        state["w"].fill_(1)
        ck.save(2, state)
        ck.wait()
        assert [r.step for r in ck.records()] == [2]
        state["w"].zero_()
        ck.load(ck.records()[0], state)
        assert torch.equal(state["w"], torch.ones(10))


def test_incomplete_folders_are_never_listed_and_are_swept(
    policy: Callable[..., CheckpointPolicy],
) -> None:
    pol = policy(keep=3)
    root = Path(pol.storage_path)
    with Checkpointer(pol, run_label="a") as ck:
        ck.save(2, {"w": torch.zeros(10)})
        ck.wait()
    # A killed save of this run, one of another run, a half-deleted checkpoint, a
    # final-named folder with no commit record, and one with a corrupt record.
    for name in (
        ".tmp-a-step_000000004",
        ".tmp-b-step_000000004",
        ".trash-step_000000000-1234",
        "step_000000006",
        "step_000000008",
    ):
        (root / name).mkdir()
        (root / name / ".metadata").write_bytes(b"x")
    (root / "step_000000008" / COMMIT_NAME).write_text("{not json")
    assert [r.step for r in list_checkpoints(root)] == [2]
    with Checkpointer(pol, run_label="a"):  # a restarted run sweeps its own leftovers
        names = sorted(p.name for p in root.iterdir())
    assert names == [".tmp-b-step_000000004", "step_000000002", "step_000000006", "step_000000008"]
    assert storage_usage(root)["leftover_bytes"] == 1
    assert [p.name for p in sweep_incomplete(root)] == [".tmp-b-step_000000004"]


def test_load_errors_have_stable_codes(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    with Checkpointer(policy()) as ck:
        ck.save(2, {"w": torch.zeros(10)})
        record = ck.wait()
        assert record is not None
        with pytest.raises(ItoError) as e:
            ck.load(record, {"other": torch.zeros(10)})
        assert e.value.code == ErrorCode.checkpoint_corrupt
        ghost = record.model_copy(update={"path": str(tmp_path / "nope"), "step": 9})
        with pytest.raises(ItoError) as e:
            ck.load(ghost, {"w": torch.zeros(10)})
        assert e.value.code == ErrorCode.checkpoint_not_found
        delete_checkpoint(record)
        assert ck.latest() is None
        with pytest.raises(ItoError) as e:
            delete_checkpoint(record)
        assert e.value.code == ErrorCode.checkpoint_not_found


def test_a_failed_save_is_reported_not_listed(policy: Callable[..., CheckpointPolicy]) -> None:
    pol = policy()
    root = Path(pol.storage_path)
    ck = Checkpointer(pol)
    # Storage vanishes under the run: the writer thread cannot create its folder.
    os.rmdir(root)
    root.write_text("not a folder")
    try:
        with pytest.raises(ItoError) as e:
            ck.save(2, {"w": torch.zeros(10)})
            ck.wait()
        assert e.value.code == ErrorCode.checkpoint_storage_unwritable
        assert ck.wait() is None  # reported once
    finally:
        ck.close()
    assert list_checkpoints(root) == []


def test_record_model_is_strict() -> None:
    with pytest.raises(ValueError):
        CheckpointRecord.model_validate(
            {
                "step": "3",
                "path": "/x",
                "bytes": 1,
                "blocking_s": 0.0,
                "total_s": 0.0,
                "bytes_per_s": 0.0,
                "created_at": 0.0,
            }
        )
