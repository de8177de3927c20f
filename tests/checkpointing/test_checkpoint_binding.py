"""A checkpoint belongs to its run: the seal binds run, account, phase and step, and
covers the commit record; the phase mark carries a MAC of its own.

Each test copies or edits a real sealed checkpoint the way a tenant with write access
to its checkpoint root could, then resumes through the Checkpointer (or checks the
phase mark) and gets the stable code. The old seal covered only the files' bytes:
every one of these was accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.checkpointing import COMMIT_NAME, Checkpointer, CheckpointPolicy
from stages.checkpointing.seal import (
    PHASE_MARK_NAME,
    SEAL_NAME,
    CheckpointBinding,
    Seal,
    SealBinding,
    seal_key,
)
from stages.checkpointing.storage import (
    CheckpointRecord,
    commit,
    final_name,
    pin_phase,
    pinned_phase,
)
from stages.errors import ErrorCode, ItoError

RUN_A = CheckpointBinding(run_id="run-a", account="acct-1")
RUN_B = CheckpointBinding(run_id="run-b", account="acct-1")


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "step": 3}


def _policy(root: Path) -> CheckpointPolicy:
    return CheckpointPolicy(storage_uri=f"file://{root}", interval_steps=1, keep=5)


def _save(root: Path, run: CheckpointBinding, step: int, *, phase: str = "pretrain") -> Path:
    with Checkpointer(_policy(root), async_staging=False, binding=run) as ck:
        ck.save(step, _state(float(step)), phase=phase)
        record = ck.wait()
    assert record is not None
    return Path(record.path)


def _resume(root: Path, run: CheckpointBinding) -> dict[str, Any]:
    """What a restarting rank does: the newest listed checkpoint, loaded."""
    state = _state(0.0)
    with Checkpointer(_policy(root), binding=run) as ck:
        latest = ck.latest()
        assert latest is not None
        ck.load(latest, state)
    return state


def _refused(root: Path, run: CheckpointBinding, code: ErrorCode) -> ItoError:
    with pytest.raises(ItoError) as e:
        _resume(root, run)
    assert e.value.code == code, e.value
    return e.value


def test_the_seal_records_run_account_phase_and_step(tmp_path: Path) -> None:
    folder = _save(tmp_path / "a", RUN_A, 3, phase="mid")
    seal = Seal.model_validate_json((folder / SEAL_NAME).read_text())
    assert seal.binding == SealBinding(run_id="run-a", account="acct-1", phase="mid", step=3)
    assert COMMIT_NAME in seal.files  # the commit record is sealed too
    assert _resume(tmp_path / "a", RUN_A)["w"].tolist() == [3.0] * 4


@pytest.mark.parametrize(
    "other", [RUN_B, CheckpointBinding(run_id="run-a", account="acct-2")], ids=["run", "account"]
)
def test_another_runs_checkpoint_copied_into_a_root_is_refused(
    tmp_path: Path, other: CheckpointBinding
) -> None:
    mine = _save(tmp_path / "a", RUN_A, 3)
    theirs = _save(tmp_path / "b", other, 9)  # newer: it would be resumed
    shutil.copytree(theirs, mine.parent / theirs.name)
    _refused(tmp_path / "a", RUN_A, ErrorCode.checkpoint_foreign)


def test_a_checkpoint_renamed_to_another_step_is_refused(tmp_path: Path) -> None:
    folder = _save(tmp_path / "a", RUN_A, 3)
    folder.rename(folder.with_name(final_name(9)))
    _refused(tmp_path / "a", RUN_A, ErrorCode.checkpoint_foreign)


@pytest.mark.parametrize("field", ["step", "run_label"])
def test_an_edited_commit_record_is_refused(tmp_path: Path, field: str) -> None:
    # The step a listing shows (and resumes by) comes from this record.
    _save(tmp_path / "a", RUN_A, 2)
    folder = _save(tmp_path / "a", RUN_A, 3)
    record = json.loads((folder / COMMIT_NAME).read_text())
    record[field] = 9 if field == "step" else "someone-else"
    (folder / COMMIT_NAME).write_text(json.dumps(record))
    _refused(tmp_path / "a", RUN_A, ErrorCode.checkpoint_untrusted)


def test_an_old_format_seal_is_refused_with_its_own_code(tmp_path: Path) -> None:
    # What the previous backend wrote: per-file digests and an HMAC over them, no
    # binding. It verifies under the old rule, and is still refused.
    folder = _save(tmp_path / "a", RUN_A, 3)
    files = {
        p.name: [p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()]
        for p in sorted(folder.iterdir())
        if p.name != SEAL_NAME
    }
    body = json.dumps(dict(sorted(files.items())), separators=(",", ":")).encode()
    mac = hmac.new(seal_key(), body, hashlib.sha256).hexdigest()
    v1 = {"version": 1, "files": {k: {"bytes": b, "sha256": h} for k, (b, h) in files.items()}}
    (folder / SEAL_NAME).write_text(json.dumps({**v1, "mac": mac}))
    err = _refused(tmp_path / "a", RUN_A, ErrorCode.checkpoint_seal_outdated)
    assert "older format" in err.message


def test_a_phase_mark_is_valid_only_where_this_backend_wrote_it(tmp_path: Path) -> None:
    a3 = _save(tmp_path / "a", RUN_A, 3)
    a4 = _save(tmp_path / "a", RUN_A, 4)

    def record(folder: Path) -> CheckpointRecord:
        return CheckpointRecord.model_validate_json((folder / COMMIT_NAME).read_text())

    assert pinned_phase(record(a3)) is None
    pin_phase(record(a3), "pretrain")
    assert pinned_phase(record(a3)) == "pretrain"
    # Copied onto another checkpoint, or written by hand: not a mark.
    shutil.copy(a3 / PHASE_MARK_NAME, a4 / PHASE_MARK_NAME)
    assert pinned_phase(record(a4)) is None
    (a4 / PHASE_MARK_NAME).write_text(
        json.dumps({"phase": "pretrain", "step": 4, "mac": secrets.token_hex(32)})
    )
    assert pinned_phase(record(a4)) is None
    # Neither is a mark of another key.
    assert pinned_phase(record(a3), secrets.token_bytes(32)) is None


def test_keep_k_deletes_a_checkpoint_whose_phase_mark_was_forged(tmp_path: Path) -> None:
    root = tmp_path / "a"
    first = _save(root, RUN_A, 1)
    (first / PHASE_MARK_NAME).write_text(
        json.dumps({"phase": "pretrain", "step": 1, "mac": secrets.token_hex(32)})
    )
    pol = CheckpointPolicy(storage_uri=f"file://{root}", interval_steps=1, keep=1)
    with Checkpointer(pol, async_staging=False, binding=RUN_A) as ck:
        ck.save(2, _state(2.0))
        ck.wait()
    assert not first.exists()  # the forged mark kept nothing beyond keep-K


def test_a_file_planted_in_the_temp_folder_during_the_save_is_never_sealed(
    tmp_path: Path,
) -> None:
    folder = _save(tmp_path / "a", RUN_A, 3)
    written = Seal.model_validate_json((folder / SEAL_NAME).read_text()).files
    del written[COMMIT_NAME]
    tmp = folder.with_name(".tmp-x-" + folder.name)
    shutil.copytree(folder, tmp)
    for name in (SEAL_NAME, COMMIT_NAME):
        (tmp / name).unlink()
    (tmp / "__7_0.distcp").write_bytes(b"planted")
    record = CheckpointRecord.model_validate_json((folder / COMMIT_NAME).read_text())
    final = folder.with_name(final_name(7))
    with pytest.raises(ItoError) as e:
        commit(tmp, final, record, seal_key(), SealBinding(step=7), written)
    assert e.value.code == ErrorCode.checkpoint_untrusted
    assert not final.exists() and not (tmp / SEAL_NAME).exists()


def test_a_symlink_planted_as_the_commit_record_is_not_written_through(tmp_path: Path) -> None:
    folder = _save(tmp_path / "a", RUN_A, 3)
    written = Seal.model_validate_json((folder / SEAL_NAME).read_text()).files
    del written[COMMIT_NAME]
    tmp = folder.with_name(".tmp-x-" + folder.name)
    shutil.copytree(folder, tmp)
    for name in (SEAL_NAME, COMMIT_NAME):
        (tmp / name).unlink()
    target = tmp_path / "outside.json"
    target.write_text("untouched")
    (tmp / COMMIT_NAME).symlink_to(target)
    record = CheckpointRecord.model_validate_json((folder / COMMIT_NAME).read_text())
    final = folder.with_name(final_name(7))
    with pytest.raises(OSError):
        commit(tmp, final, record, seal_key(), SealBinding(step=7), written)
    assert target.read_text() == "untouched"
