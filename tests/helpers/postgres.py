"""A real PostgreSQL server (Debian's ``postgresql`` package) in a temp folder.

``initdb`` + ``pg_ctl`` as an unprivileged user (PostgreSQL refuses to run as
root), listening on 127.0.0.1 at a free port, with password (scram) auth over TCP.
The password reaches the store the way it does in production: a file named by
``ITO_DB_PASSWORD_FILE``, never the URL. Each test gets its own database, dropped
after it (``drop_database``).

The cluster lives in memory (``/dev/shm`` where there is one): each ``CREATE DATABASE``
copies the template, ~12 MB of files and its WAL, and on the testbed's disk that took
0.7-0.9 s a database at load 16-24 (0.14-0.17 s in memory); a session creates ~110.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from helpers.backend import free_port
from orchestrator.db.engines import PASSWORD_FILE_ENV

PG_USER = "ito"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# Where the test cluster's folder goes: memory where the host has it, else the temp dir.
MEMORY_DIR = Path("/dev/shm")


def _cluster_parent() -> str | None:
    return str(MEMORY_DIR) if MEMORY_DIR.is_dir() and os.access(MEMORY_DIR, os.W_OK) else None


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _os_user() -> str | None:
    """The unprivileged user that runs the server (root needs one; others are one)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("no unprivileged user to run PostgreSQL as")


@dataclass
class PgServer:
    root: Path
    port: int
    password_file: Path
    os_user: str | None
    # The server's command-line settings (a restart after ``halt`` reuses them).
    options: str = ""

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{dbname}"

    def _as_user(self, *cmd: str) -> list[str]:
        return ["runuser", "-u", self.os_user, "--", *cmd] if self.os_user else list(cmd)

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL (no password in it)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(
            self.url(), password=self.password_file.read_text().strip(), autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop a database ``new_database`` made, ending any session still on it (a
        test's leftover only holds memory until the server stops, so a failed drop is
        not the test's failure)."""
        import psycopg

        name = url.rsplit("/", 1)[1]
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(
                self.url(), password=self.password_file.read_text().strip(), autocommit=True
            ) as conn,
        ):
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def halt(self) -> None:
        """Stop the server (fast shutdown: sessions are ended), keeping its data."""
        self._pg_ctl("-m", "fast", "-w", "-t", str(int(STOP_TIMEOUT_S)), "stop")

    def resume(self) -> None:
        """Start it again after ``halt``, on the same port with the same data."""
        self._pg_ctl(
            "-l",
            str(self.root / "server.log"),
            "-o",
            self.options,
            "-w",
            "-t",
            str(int(START_TIMEOUT_S)),
            "start",
        )

    def _pg_ctl(self, *args: str) -> None:
        bindir = pg_bin()
        assert bindir is not None
        subprocess.run(
            self._as_user(str(bindir / "pg_ctl"), "-D", str(self.root / "data"), *args),
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S + 10,
        )

    def stop(self) -> None:
        bindir = pg_bin()
        assert bindir is not None
        subprocess.run(
            self._as_user(
                str(bindir / "pg_ctl"),
                "-D",
                str(self.root / "data"),
                "-m",
                "immediate",
                "-w",
                "stop",
            ),
            capture_output=True,
            timeout=STOP_TIMEOUT_S,
            check=False,
        )
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PgServer:
    bindir = pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    user = _os_user()
    # Not under pytest's tmp_path: its parents are private to root.
    root = Path(tempfile.mkdtemp(prefix="ito-pg-", dir=_cluster_parent()))
    secret = uuid.uuid4().hex
    pwfile = root / "password"
    pwfile.write_text(secret + "\n")
    if user:
        info = pwd.getpwnam(user)
        os.chown(root, info.pw_uid, info.pw_gid)
        os.chown(pwfile, info.pw_uid, info.pw_gid)
    os.chmod(pwfile, 0o600)
    server = PgServer(root=root, port=free_port(), password_file=pwfile, os_user=user)
    subprocess.run(
        server._as_user(
            str(bindir / "initdb"),
            "-D",
            str(root / "data"),
            "-U",
            PG_USER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--no-sync",
            "-E",
            "UTF8",
        ),
        check=True,
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    # Small and quiet: a test server, not a benchmark of PostgreSQL's settings.
    opts = (
        f"-c listen_addresses=127.0.0.1 -c port={server.port} "
        f"-c unix_socket_directories={root} -c max_connections=200 "
        "-c shared_buffers=32MB -c fsync=off -c synchronous_commit=off "
        "-c full_page_writes=off"
    )
    server.options = opts
    server.resume()
    # The store and every backend subprocess read the password from this file.
    os.environ[PASSWORD_FILE_ENV] = str(pwfile)
    return server
