"""Checkpoints are data, not code: a planted pickle in a checkpoint folder runs nothing.

Each attack plants a pickle whose unpickling creates a marker file, then asks the
Checkpointer to load; the answer is ``checkpoint_untrusted`` and the marker never
exists. The old loader unpickled ``.metadata`` as it found it.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.checkpointing import COMMIT_NAME, Checkpointer, CheckpointPolicy, list_checkpoints
from stages.checkpointing.seal import (
    SEAL_NAME,
    CheckpointBinding,
    FileDigest,
    Seal,
    SealBinding,
    digest_bytes,
    seal_key,
)
from stages.checkpointing.sealed import SealedCheckpoint, _TensorsOnlyPlanner
from stages.checkpointing.storage import CheckpointRecord, commit, final_name
from stages.errors import ErrorCode, ItoError


class _Plant:
    """Unpickling this opens (creates) the marker file: code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "step": 3}


def _saved(policy: Callable[..., CheckpointPolicy]) -> tuple[CheckpointPolicy, CheckpointRecord]:
    pol = policy()
    with Checkpointer(pol, async_staging=False) as ck:
        ck.save(3, _state())
        record = ck.wait()
    assert record is not None and (Path(record.path) / SEAL_NAME).is_file()
    return pol, record


def _refused(pol: CheckpointPolicy, record: CheckpointRecord, marker: Path, **kw: Any) -> ItoError:
    with Checkpointer(pol, **kw) as ck, pytest.raises(ItoError) as e:
        ck.load(record, _state(0.0))
    assert e.value.code == ErrorCode.checkpoint_untrusted, e.value
    assert not marker.exists(), "the planted pickle ran"
    return e.value


def test_a_sealed_checkpoint_loads(policy: Callable[..., CheckpointPolicy]) -> None:
    pol, record = _saved(policy)
    state = _state(0.0)
    with Checkpointer(pol) as ck:
        ck.load(record, state)
    assert torch.equal(state["w"], torch.ones(4)) and state["step"] == 3


def test_a_tampered_metadata_runs_nothing(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    pol, record = _saved(policy)
    marker = tmp_path / "pwned"
    (Path(record.path) / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    _refused(pol, record, marker)


def test_a_fabricated_checkpoint_runs_nothing(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    pol = policy()
    marker = tmp_path / "pwned"
    fake = Path(pol.storage_path) / final_name(99)
    fake.mkdir(parents=True)
    (fake / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    record = CheckpointRecord(
        step=99, path=str(fake), bytes=1, blocking_s=0, total_s=0, bytes_per_s=0, created_at=0
    )
    (fake / COMMIT_NAME).write_text(record.model_dump_json())
    assert [r.step for r in list_checkpoints(pol.storage_path)] == [99]  # it is listed
    _refused(pol, record, marker)
    # A seal the tenant wrote itself: without the key its MAC cannot verify.
    digest = FileDigest(bytes=1, blake3="0" * 64)
    (fake / SEAL_NAME).write_text(
        Seal(
            version=2,
            binding=SealBinding(step=99),
            files={".metadata": digest},
            mac=secrets.token_hex(32),
        ).model_dump_json()
    )
    _refused(pol, record, marker)


def test_a_seal_of_another_key_is_refused(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    pol, record = _saved(policy)
    err = _refused(pol, record, tmp_path / "unused", seal_key=secrets.token_bytes(32))
    assert "seal does not verify" in err.message


@pytest.mark.parametrize("attack", ["added_file", "changed_file", "symlink"])
def test_files_beside_or_under_the_seal_are_refused(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path, attack: str
) -> None:
    pol, record = _saved(policy)
    folder = Path(record.path)
    data = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")[0]
    if attack == "added_file":
        (folder / "__9_0.distcp").write_bytes(b"x")
    elif attack == "changed_file":
        with data.open("r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
    else:
        copy = tmp_path / "elsewhere.distcp"
        copy.write_bytes(data.read_bytes())
        data.unlink()
        data.symlink_to(copy)
    _refused(pol, record, tmp_path / "unused")


def test_non_tensor_items_are_unpickled_weights_only(tmp_path: Path) -> None:
    # The second line of defence, for a data file swapped after its check.
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Plant(marker), buf)
    buf.seek(0)
    planner = _TensorsOnlyPlanner()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, buf)  # type: ignore[arg-type]
    assert not marker.exists()


def test_a_metadata_swapped_during_the_save_is_never_sealed(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    # The save's temp folder is in the tenant's root too: a .metadata replaced between
    # DCP's write and the seal must not become a sealed (trusted) checkpoint.
    _pol, record = _saved(policy)
    folder = Path(record.path)
    written = Seal.model_validate_json((folder / SEAL_NAME).read_text()).files
    del written[COMMIT_NAME]
    tmp = folder.with_name(".tmp-x-" + folder.name)
    shutil.copytree(folder, tmp)
    (tmp / SEAL_NAME).unlink()
    (tmp / COMMIT_NAME).unlink()
    (tmp / ".metadata").write_bytes(pickle.dumps(_Plant(tmp_path / "pwned")))
    final = folder.with_name(final_name(7))
    with pytest.raises(ItoError) as e:
        commit(tmp, final, record, secrets.token_bytes(32), SealBinding(step=7), written)
    assert e.value.code == ErrorCode.checkpoint_untrusted
    assert not final.exists() and not (tmp / SEAL_NAME).exists()


def test_the_seal_covers_the_metadata_bytes_dcp_wrote_even_from_a_copy(
    policy: Callable[..., CheckpointPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11's FileSystemWriter.finish pickles dataclasses.replace(metadata, ...):
    # the object the caller holds is not what was written. The seal must still match
    # the file (a digest of a re-pickled object refused every checkpoint there).
    import dataclasses

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    finish = _FileSystemWriter.finish

    def finish_a_copy(self: Any, metadata: Any, results: Any) -> None:
        finish(self, dataclasses.replace(metadata), results)

    monkeypatch.setattr(_FileSystemWriter, "finish", finish_a_copy)
    _pol, record = _saved(policy)
    folder = Path(record.path)
    sealed = Seal.model_validate_json((folder / SEAL_NAME).read_text())
    written = digest_bytes((folder / ".metadata").read_bytes())
    assert sealed.files[".metadata"] == written


def test_the_metadata_is_unpickled_from_the_checked_bytes_not_read_again(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    # Swapped between the seal check and DCP's load: a loader that reads .metadata
    # from disk again (DCP's own FileSystemReader.read_metadata) would unpickle it.
    _pol, record = _saved(policy)
    folder = Path(record.path)
    sealed = SealedCheckpoint(folder, seal_key(), CheckpointBinding())
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    assert set(sealed.tensors()) == {"w"}
    state = _state(0.0)
    sealed.load(state)
    assert not marker.exists(), "the swapped .metadata was unpickled"
    assert torch.equal(state["w"], torch.ones(4)) and state["step"] == 3


def test_a_rank_checks_only_the_files_it_reads(
    policy: Callable[..., CheckpointPolicy], tmp_path: Path
) -> None:
    # Two writer threads: two data files. One of them is damaged after the save; a
    # load that needs only the other one succeeds, one that reads it is refused.
    pol = policy()
    state = {"a": torch.full((1000,), 1.0), "b": torch.full((1000,), 2.0)}
    with Checkpointer(pol, async_staging=False, writer_threads=2) as ck:
        ck.save(3, state)
        record = ck.wait()
    assert record is not None
    folder = Path(record.path)
    sealed = SealedCheckpoint(folder, seal_key(), CheckpointBinding())
    md = pickle.loads(sealed.metadata_bytes)
    where = {idx.fqn: info.relative_path for idx, info in md.storage_data.items()}
    assert where["a"] != where["b"]
    data = folder / where["b"]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    again = SealedCheckpoint(folder, seal_key(), CheckpointBinding())  # the seal holds
    a = {"a": torch.zeros(1000)}
    again.load(a)
    assert torch.equal(a["a"], state["a"])
    with pytest.raises(ItoError) as e:
        again.load({"b": torch.zeros(1000)})
    assert e.value.code == ErrorCode.checkpoint_untrusted


def test_each_file_is_hashed_once_per_sealed_checkpoint(
    policy: Callable[..., CheckpointPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A phase end reads the closing checkpoint for the export share, the units and the
    # battery: the seal and each file are checked once, not once per reader.
    from stages.checkpointing import seal as seal_mod

    _pol, record = _saved(policy)
    checked: list[str] = []
    check = seal_mod.check_open_file

    def counted(folder: Path, fd: int, seal: Seal, name: str) -> None:
        checked.append(name)
        check(folder, fd, seal, name)

    monkeypatch.setattr(seal_mod, "check_open_file", counted)
    sealed = SealedCheckpoint(Path(record.path), seal_key(), CheckpointBinding())
    for _ in range(3):
        sealed.load(_state(0.0))
    assert checked and len(checked) == len(set(checked))


def test_the_zip_crc_is_off_only_while_a_checkpoint_is_written(
    policy: Callable[..., CheckpointPolicy],
) -> None:
    # torch's setting is process-wide: the writer must give it back.
    from torch.utils.serialization import config

    assert config.save.compute_crc32
    _pol, record = _saved(policy)
    assert config.save.compute_crc32
    state = _state(0.0)
    with Checkpointer(_pol) as ck:
        ck.load(record, state)  # written without the CRC, read as ever
    assert torch.equal(state["w"], torch.ones(4))
