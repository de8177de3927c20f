"""Where the client's API key comes from, and how it is kept out of every output.

Only two sources, never a command-line flag (argv is visible in ``ps`` and shell
history): the ``ITO_API_KEY`` environment variable, or a credentials file
(``ITO_CREDENTIALS_FILE``, default ``~/.config/ito/credentials``) that is a regular
file, not a symlink, owned by the caller, and readable by nobody else: exactly 0600
or 0400, reached by the same symlink-safe walk as manifests (``stages/safepath.py``).

The key is wrapped in ``ApiKey`` whose ``repr``/``str`` are redacted, so it cannot
leak through a log line or an exception message by accident; ``redact`` scrubs it
from any text the CLI is about to print, as a second line of defence.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from stages import safepath
from stages.errors import ErrorCode, ItoError
from stages.safepath import WalkError

API_KEY_ENV = "ITO_API_KEY"
CREDENTIALS_FILE_ENV = "ITO_CREDENTIALS_FILE"
DEFAULT_CREDENTIALS_FILE = "~/.config/ito/credentials"
CREDENTIALS_MAX_BYTES = 64 * 1024
REDACTED = "[redacted]"
# "ITO_API_KEY=...", "export ITO_API_KEY=..." or "api_key = ..."; a bare key otherwise.
_ASSIGN = re.compile(r"^(?:export\s+)?(?:ITO_API_KEY|api_key)\s*=\s*(.*)$", re.IGNORECASE)


class ApiKey:
    """An API key that never prints itself."""

    __slots__ = ("_secret", "source")

    def __init__(self, secret: str, source: str):
        self._secret = secret
        self.source = source  # "env" or the credentials file path; safe to show

    def reveal(self) -> str:
        """The secret, for the Authorization header only."""
        return self._secret

    @property
    def key_id(self) -> str | None:
        # Keys look like itok_<key_id>_<secret>; the id part is not secret.
        parts = self._secret.split("_", 2)
        return parts[1] if len(parts) == 3 and parts[0] == "itok" else None

    def __repr__(self) -> str:
        return f"ApiKey(source={self.source!r}, secret={REDACTED})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("ApiKey is not picklable")


def redact(text: str, *secrets: str | None) -> str:
    """Replace every occurrence of each non-empty secret in ``text``."""
    for s in secrets:
        if s:
            text = text.replace(s, REDACTED)
    return text


def _insecure(path: str, why: str) -> ItoError:
    return ItoError(ErrorCode.credentials_file_insecure, f"credentials file {path!r}: {why}")


def _parse(raw: str) -> str | None:
    """First non-comment line; ``ITO_API_KEY=...`` / ``api_key = ...`` forms accepted."""
    for line in raw.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _ASSIGN.match(line)
        if m:
            line = m.group(1).strip().strip("'\"")
        return line or None
    return None


def read_credentials_file(path: str) -> ApiKey | None:
    """Read a key from ``path``; ``None`` if the file does not exist."""
    # The same symlink-safe walk as the manifest reader: canonical absolute path, no
    # symlink on any component (a symlinked ~/.config is refused too).
    try:
        fd, _ = safepath.walk(
            os.open("/", safepath.DIR_FLAGS),
            safepath.path_parts(path),
            want="any",
            allow_missing=True,
        )
    except WalkError as exc:
        why = {
            "symlink": "a symlink is on its path",
            "not_absolute": "path is not absolute",
            "not_canonical": "path is not canonical",
            "not_regular": "not a regular file",
            "not_dir": "a component of its path is not a directory",
        }.get(exc.kind, os.strerror(exc.errno) if exc.errno else "cannot open")
        raise _insecure(path, why) from None
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _insecure(path, "not a regular file")
        if st.st_uid != os.geteuid():
            raise _insecure(path, f"owned by uid {st.st_uid}, not the caller")
        if stat.S_IMODE(st.st_mode) not in (0o600, 0o400):
            raise _insecure(
                path,
                f"mode {stat.S_IMODE(st.st_mode):04o}; must be 0600 or 0400 (chmod 600 {path})",
            )
        raw = os.read(fd, CREDENTIALS_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > CREDENTIALS_MAX_BYTES:
        raise _insecure(path, "too large")
    secret = _parse(raw.decode("utf-8", errors="replace"))
    if not secret:
        raise ItoError(ErrorCode.credentials_missing, f"credentials file {path!r} holds no key")
    return ApiKey(secret, source=path)


def load_api_key(environ: Mapping[str, str] | None = None) -> ApiKey:
    """The caller's key: ``ITO_API_KEY`` first, then the credentials file."""
    env = os.environ if environ is None else environ
    secret = env.get(API_KEY_ENV, "").strip()
    if secret:
        return ApiKey(secret, source="env")
    explicit = env.get(CREDENTIALS_FILE_ENV)
    path = explicit or str(Path(DEFAULT_CREDENTIALS_FILE).expanduser())
    key = read_credentials_file(path)
    if key is None:
        raise ItoError(
            ErrorCode.credentials_missing,
            f"no API key: set {API_KEY_ENV} or write it to {path} (mode 0600)",
        )
    return key
