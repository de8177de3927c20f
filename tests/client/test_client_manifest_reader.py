"""The client's manifest reader refuses every unsafe path before any request.

The reader-level tests name each refusal's code; the CLI-level tests point the
client at a recording proxy and prove that none of the attacks produced a single
request (with a positive control showing the recorder does see a good manifest).
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
from pathlib import Path

import pytest
from client_proxy import RecordingProxy
from helpers.tools import require_root

from orchestrator.client.api import ItoClient
from orchestrator.client.cli import EXIT_REFUSED, run_cli
from orchestrator.client.manifest_reader import MANIFEST_MAX_BYTES, read_manifest
from stages.errors import ErrorCode, ItoError

MANIFEST = b'{"model": {"preset": "llama-tiny"}}\n'


def _write(path: Path, data: bytes = MANIFEST, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return _write(tmp_path / "m.json")


def _code(path: str, **kw: object) -> ErrorCode:
    with pytest.raises(ItoError) as info:
        read_manifest(path, **kw)  # type: ignore[arg-type]
    return info.value.code


def test_reads_exact_bytes_and_digest(good: Path) -> None:
    mb = read_manifest(str(good))
    assert mb.data == MANIFEST
    assert mb.digest == hashlib.sha256(MANIFEST).hexdigest()
    assert mb.manifest_id == "mf_" + mb.digest[:24]


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("m.json", ErrorCode.manifest_path_not_absolute),
        ("./m.json", ErrorCode.manifest_path_not_absolute),
        ("", ErrorCode.manifest_path_not_absolute),
        ("/tmp/../tmp/m.json", ErrorCode.manifest_path_not_canonical),
        ("/tmp//m.json", ErrorCode.manifest_path_not_canonical),
        ("/tmp/./m.json", ErrorCode.manifest_path_not_canonical),
        ("/tmp/m.json/", ErrorCode.manifest_path_not_canonical),
        ("/", ErrorCode.manifest_path_not_canonical),
        ("/tmp/m\x00.json", ErrorCode.manifest_path_not_canonical),
    ],
)
def test_path_shape(path: str, code: ErrorCode) -> None:
    assert _code(path) == code


def test_symlink_file(good: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert _code(str(link)) == ErrorCode.manifest_symlink


def test_symlink_parent_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    _write(real / "m.json")
    (tmp_path / "via").symlink_to(real)
    assert _code(str(tmp_path / "via" / "m.json")) == ErrorCode.manifest_symlink
    # ...and a symlink higher up the path is caught as well.
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    _write(deep / "m.json")
    (tmp_path / "alias").symlink_to(tmp_path / "a")
    assert _code(str(tmp_path / "alias" / "b" / "m.json")) == ErrorCode.manifest_symlink


@pytest.mark.timeout(20)
def test_fifo_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo, 0o600)
    # No writer: a blocking open would hang here (and the timeout would fail the test).
    assert _code(str(fifo)) == ErrorCode.manifest_not_regular_file


def test_directory(tmp_path: Path) -> None:
    d = tmp_path / "m.json"
    d.mkdir(mode=0o700)
    assert _code(str(d)) == ErrorCode.manifest_not_regular_file


def test_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "m.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert _code(str(path)) == ErrorCode.manifest_not_regular_file


def test_oversized(tmp_path: Path) -> None:
    big = _write(tmp_path / "m.json", b" " * (MANIFEST_MAX_BYTES + 1))
    assert _code(str(big)) == ErrorCode.manifest_too_large
    exact = _write(tmp_path / "ok.json", b" " * MANIFEST_MAX_BYTES)
    assert len(read_manifest(str(exact)).data) == MANIFEST_MAX_BYTES
    assert _code(str(exact), max_bytes=10) == ErrorCode.manifest_too_large


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666, 0o660])
def test_group_or_world_writable(tmp_path: Path, mode: int) -> None:
    f = _write(tmp_path / "m.json", mode=mode)
    assert stat.S_IMODE(f.stat().st_mode) == mode
    assert _code(str(f)) == ErrorCode.manifest_insecure_permissions


def test_readable_by_others_is_fine(tmp_path: Path) -> None:
    # Only writability matters: a 0644 manifest cannot be changed behind our back.
    f = _write(tmp_path / "m.json", mode=0o644)
    assert read_manifest(str(f)).data == MANIFEST


def test_other_owner(good: Path) -> None:
    require_root("chown to another uid")
    os.chown(good, 4242, 4242)
    assert _code(str(good)) == ErrorCode.manifest_not_owned


def test_owner_is_checked_against_the_callers_euid(good: Path) -> None:
    assert _code(str(good), euid=os.geteuid() + 1) == ErrorCode.manifest_not_owned


def test_missing_and_file_as_directory(good: Path, tmp_path: Path) -> None:
    assert _code(str(tmp_path / "absent.json")) == ErrorCode.manifest_unreadable
    assert _code(str(good) + "/x.json") == ErrorCode.manifest_unreadable


# --- through the CLI: none of the attacks reaches the server -----------------------------


def _attack(kind: str, tmp_path: Path) -> Path:
    if kind == "symlink_file":
        link = tmp_path / "link.json"
        link.symlink_to(_write(tmp_path / "m.json"))
        return link
    if kind == "symlink_parent":
        real = tmp_path / "real"
        real.mkdir()
        _write(real / "m.json")
        (tmp_path / "via").symlink_to(real)
        return tmp_path / "via" / "m.json"
    if kind == "fifo":
        os.mkfifo(tmp_path / "m.json", 0o600)
    elif kind == "directory":
        (tmp_path / "m.json").mkdir()
    elif kind == "oversized":
        _write(tmp_path / "m.json", b"{" * (MANIFEST_MAX_BYTES + 1))
    elif kind == "world_writable":
        _write(tmp_path / "m.json", mode=0o666)
    elif kind == "other_owner":
        os.chown(_write(tmp_path / "m.json"), 4242, 4242)
    return tmp_path / "m.json"


ATTACKS = {
    "symlink_file": ErrorCode.manifest_symlink,
    "symlink_parent": ErrorCode.manifest_symlink,
    "fifo": ErrorCode.manifest_not_regular_file,
    "directory": ErrorCode.manifest_not_regular_file,
    "oversized": ErrorCode.manifest_too_large,
    "world_writable": ErrorCode.manifest_insecure_permissions,
    "other_owner": ErrorCode.manifest_not_owned,
}


def _fast_client(url: str, key: object, settings: object) -> ItoClient:
    s = settings.model_copy(update={"retry_backoff_s": 0.0, "total_timeout_s": 5.0})  # type: ignore[attr-defined]
    return ItoClient(url, key, settings=s)  # type: ignore[arg-type]


def _argvs(path: Path, url: str) -> list[list[str]]:
    m = str(path)
    return [
        [
            "train",
            "--booking",
            "bk_1",
            "--manifest",
            m,
            "--confirmation-ref",
            "cref",
            "--idempotency-key",
            "k1",
            "--json",
            "--api-url",
            url,
        ],
        ["plan", "--booking", "bk_1", "--manifest", m, "--json", "--api-url", url],
        [
            "confirm",
            "--action",
            "train",
            "--booking",
            "bk_1",
            "--manifest",
            m,
            "--json",
            "--api-url",
            url,
        ],
    ]


@pytest.mark.parametrize("kind", sorted(ATTACKS))
def test_attacks_never_reach_the_server(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if kind == "other_owner":
        require_root("chown to another uid")
    monkeypatch.setenv("ITO_API_KEY", "itok_test_notasecret")
    path = _attack(kind, tmp_path)
    with RecordingProxy(upstream_port=None) as proxy:
        for argv in _argvs(path, proxy.url):
            status, env = run_cli(argv, client_factory=_fast_client)
            assert status == EXIT_REFUSED
            assert env["ok"] is False and env["live_api_contacted"] is False
            assert env["error"]["code"] == ATTACKS[kind]
        assert proxy.requests == []
    capsys.readouterr()


def test_positive_control_good_manifest_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ITO_API_KEY", "itok_test_notasecret")
    path = _write(tmp_path / "m.json")
    with RecordingProxy(upstream_port=None) as proxy:
        for argv in _argvs(path, proxy.url):
            run_cli(argv, client_factory=_fast_client)
        assert proxy.matching("POST", "/v1/runs")
        assert proxy.matching("POST", "/v1/plans")
    capsys.readouterr()
