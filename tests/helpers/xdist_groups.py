"""The pytest-xdist groups of the suite. With ``ITO_TEST_WORKERS=N``, ``scripts/test.sh``
runs the tests on N workers with ``--dist loadgroup``: the tests of one group run on
one worker, one after another, and every other test goes to whichever worker is free.

- ``ray-local:<module>``: a module's tests on the session's in-process Ray (the
  ``ray_local`` fixture; tests/conftest.py puts them there). Each worker's session
  starts that cluster at most once, and such modules spread over the workers: the
  suite starts at most one in-process Ray per worker.

A test module with an expensive module fixture (a Ray cluster, daemons, a server with
its embedded Ray head) is a group of its own (``module_group``), so one worker builds
that fixture once. Servers with an embedded head may run on several workers at once:
every port of their heads is a free one (``helpers.ray_backend``)."""

from __future__ import annotations

import pytest

RAY_LOCAL = "ray-local"


def ray_local_group(module_name: str) -> pytest.MarkDecorator:
    """The group of one module's tests on the session's local Ray."""
    return pytest.mark.xdist_group(f"{RAY_LOCAL}:{module_name}")


def module_group(module_name: str) -> pytest.MarkDecorator:
    """The group of one module's tests: ``pytestmark = module_group(__name__)``."""
    return pytest.mark.xdist_group(module_name)
