"""Where the API key comes from, and that it is never printed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.tools import require_root

from orchestrator.client.cli import EXIT_REFUSED, build_parser, run_cli
from orchestrator.client.credentials import (
    REDACTED,
    ApiKey,
    load_api_key,
    read_credentials_file,
    redact,
)
from stages.errors import ErrorCode, ItoError

SECRET = "itok_k1_CANARYsecretVALUE0123456789"


def _cred(tmp_path: Path, text: str = SECRET + "\n", mode: int = 0o600) -> Path:
    p = tmp_path / "credentials"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_env_wins(tmp_path: Path) -> None:
    other = _cred(tmp_path, "itok_k2_fromfile\n")
    key = load_api_key({"ITO_API_KEY": SECRET, "ITO_CREDENTIALS_FILE": str(other)})
    assert key.reveal() == SECRET and key.source == "env"
    assert key.key_id == "k1"


@pytest.mark.parametrize(
    "text",
    [
        SECRET,
        f"# ito\n\n{SECRET}\n",
        f"ITO_API_KEY={SECRET}",
        f"export ITO_API_KEY='{SECRET}'",
        f"api_key = {SECRET}",
    ],
)
def test_file_forms(tmp_path: Path, text: str) -> None:
    key = load_api_key({"ITO_CREDENTIALS_FILE": str(_cred(tmp_path, text))})
    assert key.reveal() == SECRET


def test_padding_in_a_bare_key_is_kept(tmp_path: Path) -> None:
    key = read_credentials_file(str(_cred(tmp_path, "itok_k1_abc==\n")))
    assert key is not None and key.reveal() == "itok_k1_abc=="


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666])
def test_file_must_be_private(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ItoError) as info:
        load_api_key({"ITO_CREDENTIALS_FILE": str(_cred(tmp_path, mode=mode))})
    assert info.value.code == ErrorCode.credentials_file_insecure
    assert SECRET not in str(info.value)


def test_0400_is_fine(tmp_path: Path) -> None:
    assert (
        load_api_key({"ITO_CREDENTIALS_FILE": str(_cred(tmp_path, mode=0o400))}).reveal() == SECRET
    )


def test_file_owned_by_someone_else(tmp_path: Path) -> None:
    require_root("chown to another uid")
    p = _cred(tmp_path)
    os.chown(p, 4242, 4242)
    with pytest.raises(ItoError) as info:
        load_api_key({"ITO_CREDENTIALS_FILE": str(p)})
    assert info.value.code == ErrorCode.credentials_file_insecure


def test_symlinked_file_refused(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(_cred(tmp_path))
    with pytest.raises(ItoError) as info:
        load_api_key({"ITO_CREDENTIALS_FILE": str(link)})
    assert info.value.code == ErrorCode.credentials_file_insecure


def test_missing(tmp_path: Path) -> None:
    with pytest.raises(ItoError) as info:
        load_api_key({"ITO_CREDENTIALS_FILE": str(tmp_path / "nope")})
    assert info.value.code == ErrorCode.credentials_missing
    with pytest.raises(ItoError) as info:
        load_api_key({"ITO_CREDENTIALS_FILE": str(_cred(tmp_path, "# nothing\n"))})
    assert info.value.code == ErrorCode.credentials_missing


def test_default_path_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".config" / "ito").mkdir(parents=True)
    _cred(tmp_path / ".config" / "ito")
    assert load_api_key({}).source == str(tmp_path / ".config" / "ito" / "credentials")


def test_key_never_prints_itself() -> None:
    key = ApiKey(SECRET, source="env")
    for text in (repr(key), str(key), f"{key}", f"{key!r}", str([key]), str({"k": key})):
        assert SECRET not in text and REDACTED in text
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(key)
    assert redact(f"a {SECRET} b {SECRET}", SECRET) == f"a {REDACTED} b {REDACTED}"
    assert redact("x", None, "") == "x"


def test_no_flag_takes_a_secret() -> None:
    # Walk every subcommand's options: none is a key, token, password or secret.
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        for action in p._actions:
            for opt in action.option_strings:
                assert not any(w in opt for w in ("key", "token", "secret", "password")) or (
                    opt == "--idempotency-key"
                ), (name, opt)


def test_insecure_file_is_a_client_side_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ITO_API_KEY", raising=False)
    monkeypatch.setenv("ITO_CREDENTIALS_FILE", str(_cred(tmp_path, mode=0o644)))
    status, env = run_cli(["status", "--run", "r1", "--json", "--api-url", "http://127.0.0.1:9"])
    assert status == EXIT_REFUSED
    assert env["error"]["code"] == ErrorCode.credentials_file_insecure
    assert env["live_api_contacted"] is False
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
