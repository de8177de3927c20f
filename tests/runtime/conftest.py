"""Fixtures of the runtime modules."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.testbed_runs import shared_paced_server


@pytest.fixture(scope="session")
def paced_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One paced Ray-backed server for test_run_controls_on_ray.py,
    test_runs_curriculum_on_ray.py and test_runs_on_ray.py, which run one after the
    other (helpers.testbed_runs.shared_paced_server); each module's ``rt`` fixture is
    ``serve_module`` over it."""
    canary = "sk-canary" + uuid.uuid4().hex
    yield from shared_paced_server(tmp_path_factory.mktemp("ray-runtime"), canary)
