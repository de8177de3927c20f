"""``stages.atomic_write``: a file appears whole or not at all, with the bits asked for,
fsynced (file, then folder) only when durable."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages import atomic_write
from stages.atomic_write import fsync_dir, open_atomic, write_bytes, write_text

REPO = Path(__file__).resolve().parents[1]
OLD = b"old content\n"


@pytest.fixture
def umask() -> Iterator[None]:
    """A strict umask for the test (0o077), restored after it."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_write_bytes_and_text_replace_the_file(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_bytes(OLD)
    write_bytes(target, b'{"a": 1}')
    assert target.read_bytes() == b'{"a": 1}'
    write_text(target, "é\n", durable=False)
    assert target.read_bytes() == "é\n".encode()
    with open_atomic(target, "w") as f:
        json.dump({"k": [1, 2]}, f)
    assert json.loads(target.read_text()) == {"k": [1, 2]}
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_failed_serialisation_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(OLD)
    # json.dump writes the big field before it reaches the one it cannot encode.
    doc = {"big": "x" * (1 << 20), "bad": object()}
    with pytest.raises(TypeError), open_atomic(target, "w") as f:
        json.dump(doc, f)
    assert target.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_rename_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)

    def refuse(src: object, dst: object) -> None:
        raise OSError("rename refused")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="rename refused"):
        write_bytes(target, b"new" * 1000)
    assert target.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["f.bin"]


def test_a_new_file_appears_only_whole(tmp_path: Path) -> None:
    target = tmp_path / "new.bin"
    with open_atomic(target) as f:
        f.write(b"part one, ")
        assert not target.exists()  # nothing under the name until the block ends
        f.write(b"part two")
    assert target.read_bytes() == b"part one, part two"


def test_two_writers_of_one_file_never_share_a_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    a, b = b"A" * 100_000, b"B" * 50_000
    with open_atomic(target) as fa:
        fa.write(a[:50_000])
        with open_atomic(target) as fb:
            fb.write(b)
            assert len(os.listdir(tmp_path)) == 2  # two temps
        assert target.read_bytes() == b
        fa.write(a[50_000:])
    assert target.read_bytes() == a  # the later rename wins, whole
    assert os.listdir(tmp_path) == ["f.bin"]


_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from stages.atomic_write import open_atomic, write_bytes

    target = sys.argv[1]
    write_bytes(target, b"version 1\\n" * 1000)
    chunk = b"version 2\\n" * 100_000  # ~1 MiB
    with open_atomic(target) as f:
        while True:  # a payload that never ends: the parent kills us mid-write
            f.write(chunk)
    """
)


def test_a_writer_killed_mid_write_never_leaves_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(target)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120  # a hung child fails the test, never a pass

        def temp_bytes() -> int:
            total = 0
            for p in tmp_path.iterdir():
                if p.name == target.name:
                    continue
                # Version 1's temp may be listed and renamed onto the target before its stat.
                with contextlib.suppress(FileNotFoundError):
                    total += p.stat().st_size
            return total

        while temp_bytes() < 8 << 20:  # killed only once version 2 is well under way
            assert proc.poll() is None, "the writer exited on its own"
            assert time.monotonic() < deadline, "the writer never got going"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert target.read_bytes() == b"version 1\n" * 1000
    left = [p.name for p in tmp_path.iterdir() if p.name != target.name]
    assert len(left) == 1 and left[0].startswith(".big.bin.") and left[0].endswith(".tmp")


def test_perms_are_exact_whatever_the_umask(tmp_path: Path, umask: None) -> None:
    private, shared, default = tmp_path / "p", tmp_path / "s", tmp_path / "d"
    write_bytes(private, b"x", perms=0o600)
    write_bytes(shared, b"x", perms=0o644)  # more than the umask 0o077 lets through
    write_text(default, "x")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(shared.stat().st_mode) == 0o644
    # No perms: what open() gives a new file (0o666 less the umask).
    assert stat.S_IMODE(default.stat().st_mode) == 0o600
    write_bytes(private, b"y", perms=0o640)  # a replace takes the new bits
    assert stat.S_IMODE(private.stat().st_mode) == 0o640


def _spy_fsync(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[tuple[str, bytes]]:
    """Record each fsync: what it synced (file or dir) and the target's content then."""
    calls: list[tuple[str, bytes]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        calls.append((kind, target.read_bytes() if target.exists() else b""))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_durable_fsyncs_the_file_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)
    calls = _spy_fsync(monkeypatch, target)
    write_bytes(target, b"new")
    assert calls == [("file", OLD), ("dir", b"new")]
    calls.clear()
    with open_atomic(target, "w") as f:
        f.write("text")
    assert calls == [("file", b"new"), ("dir", b"text")]


def test_not_durable_never_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.bin"
    calls = _spy_fsync(monkeypatch, target)
    write_bytes(target, b"a", durable=False)
    write_text(target, "b", durable=False)
    with open_atomic(target, "wb", durable=False) as f:
        f.write(b"c")
    assert target.read_bytes() == b"c"
    assert calls == []


def test_fsync_dir_syncs_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_fsync(monkeypatch, tmp_path / "unused")
    fsync_dir(tmp_path)
    assert calls == [("dir", b"")]


def test_exclusive_never_replaces_a_file_or_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    write_bytes(target, b"first", exclusive=True, perms=0o600)
    assert target.read_bytes() == b"first"
    with pytest.raises(FileExistsError):
        write_bytes(target, b"second", exclusive=True)
    assert target.read_bytes() == b"first"
    victim = tmp_path / "victim"
    victim.write_bytes(OLD)
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_bytes(link, b"through the link?", exclusive=True)
    assert victim.read_bytes() == OLD and link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["link.json", "m.json", "victim"]


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(OLD)
    link = tmp_path / "f.json"
    link.symlink_to(victim)
    write_bytes(link, b"new")
    assert victim.read_bytes() == OLD
    assert not link.is_symlink() and link.read_bytes() == b"new"


def test_unknown_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        atomic_write.open_atomic(tmp_path / "f", "ab")  # type: ignore[call-overload]


def test_a_file_planted_at_the_temp_name_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The temp name is random; fix it here so a symlink can be planted under it.
    monkeypatch.setattr(atomic_write.secrets, "token_hex", lambda n: "guessed")
    victim = tmp_path / "victim"
    victim.write_bytes(OLD)
    (tmp_path / ".f.json.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_bytes(tmp_path / "f.json", b"new")
    assert victim.read_bytes() == OLD and not (tmp_path / "f.json").exists()
