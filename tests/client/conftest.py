"""Fixtures of the client tests live in client_world (importable by the tests too)."""

from client_world import server, world  # noqa: F401
