"""The pytest-xdist groups of the suite. ``scripts/test.sh`` runs the tests on several
workers with ``--dist loadgroup``: the tests of one group run on one worker, one after
another, and every other test goes to whichever worker is free.

- ``ray-local``: every test on the session's in-process Ray (the ``ray_local``
  fixture; tests/conftest.py puts them here), so the suite starts that cluster once.
- ``embedded-ray-head``: every test whose ``ito-backend serve --runtime ray`` (or the
  pipeline benchmark's server) starts an embedded Ray head. Its Ray Client server
  listens on the default port 10001, which the server has no option for, so two
  such heads at once would collide; this group never runs two.

A test module with an expensive module fixture (a Ray cluster, daemons) is a group of
its own (``module_group``), so one worker builds that fixture once."""

from __future__ import annotations

import pytest

RAY_LOCAL = "ray-local"
EMBEDDED_RAY_HEAD = "embedded-ray-head"

ray_local_group = pytest.mark.xdist_group(RAY_LOCAL)
embedded_ray_head_group = pytest.mark.xdist_group(EMBEDDED_RAY_HEAD)


def module_group(module_name: str) -> pytest.MarkDecorator:
    """The group of one module's tests: ``pytestmark = module_group(__name__)``."""
    return pytest.mark.xdist_group(module_name)
