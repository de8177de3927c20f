"""Pytest fixtures built on the helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.backend import Backend, start_backend
from helpers.tenants import Tenant, make_tenant


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
