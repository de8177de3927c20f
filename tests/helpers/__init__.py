"""Shared test helpers (server as a real subprocess, tenants, manifests).

``tests/`` is on ``sys.path`` under pytest (the root conftest has no package), so
import them as ``from helpers.backend import Backend`` etc. Fixtures ready to use
live in ``helpers.fixtures``; pull them into a conftest with
``from helpers.fixtures import backend, tenant  # noqa: F401``.
"""
