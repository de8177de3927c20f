"""Pytest fixtures built on the helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.backend import Backend, start_backend
from helpers.postgres import PgServer, pg_bin, start_postgres
from helpers.tenants import Tenant, make_tenant
from helpers.tools import missing

ENGINES = ("sqlite", "postgresql")
# A contract test module runs on both engines: ``pytestmark = both_engines``.
both_engines = pytest.mark.parametrize("engine", ENGINES, indirect=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One real PostgreSQL server for the session; each test makes its own database.
    CI installs postgresql and fails without it (ITO_REQUIRE_POSTGRES=1)."""
    if pg_bin() is None:
        missing("postgres", "PostgreSQL is not installed (apt-get install postgresql)")
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> str:
    """The store's engine: SQLite unless the module runs ``both_engines``."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def db(engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty store of ``engine``: a SQLite file path or a PostgreSQL URL (its
    database dropped after the test: the session's cluster is in memory)."""
    if engine != "postgresql":
        yield str(tmp_path / "ito.db")
        return
    server: PgServer = request.getfixturevalue("pg_server")
    url = server.new_database()
    try:
        yield url
    finally:
        server.drop_database(url)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Backend]:
    """A running ``ito-backend serve`` (real subprocess) on a temp DB."""
    b = start_backend(tmp_path / "backend")
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def tenant(backend: Backend) -> Tenant:
    """Account ``acme`` with a submitter key, an approver key and a live booking."""
    return make_tenant(backend.db, "acme")
