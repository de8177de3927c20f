"""The per-run secret's challenge-response and the listener binding, over real sockets."""

from __future__ import annotations

import socket
import threading

import pytest

from stages.netsec import (
    ListenerConfig,
    PeerRefused,
    RunSecret,
    accept_peer,
    bind_listener,
    prove_to_peer,
)


def _handshake(server_key: bytes, client_key: bytes) -> tuple[BaseException | None, ...]:
    listener = bind_listener("127.0.0.1", ListenerConfig())
    results: dict[str, BaseException | None] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            try:
                accept_peer(conn, server_key, 5.0)
                results["server"] = None
            except PeerRefused as e:
                results["server"] = e

    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(listener.getsockname()[:2]) as c:
        try:
            prove_to_peer(c, client_key, 5.0)
            results["client"] = None
        except PeerRefused as e:
            results["client"] = e
    t.join(10)
    listener.close()
    return results["server"], results["client"]


def test_peers_with_the_run_secret_prove_it_to_each_other() -> None:
    key = RunSecret.new().derive("weight-sync")
    assert _handshake(key, key) == (None, None)


def test_a_stranger_or_another_purpose_is_refused_on_both_sides() -> None:
    secret = RunSecret.new()
    server_err, client_err = _handshake(secret.derive("heal"), RunSecret.new().derive("heal"))
    assert isinstance(server_err, PeerRefused) and isinstance(client_err, PeerRefused)
    server_err, _ = _handshake(secret.derive("heal"), secret.derive("weight-sync"))
    assert isinstance(server_err, PeerRefused)


def test_a_silent_client_times_out_instead_of_holding_the_listener() -> None:
    listener = bind_listener("127.0.0.1", ListenerConfig())
    with socket.create_connection(listener.getsockname()[:2]):
        conn, _ = listener.accept()
        with conn, pytest.raises(PeerRefused):
            accept_peer(conn, b"k" * 32, 0.2)
    listener.close()


def test_listeners_bind_the_given_address_in_the_configured_range() -> None:
    probe = bind_listener("127.0.0.1", ListenerConfig())
    base = probe.getsockname()[1]
    probe.close()
    cfg = ListenerConfig(port_min=base, port_max=base + 5)
    first = bind_listener("127.0.0.1", cfg)
    second = bind_listener("127.0.0.1", cfg)
    try:
        for s in (first, second):
            host, port = s.getsockname()[:2]
            assert host == "127.0.0.1" and base <= port <= base + 5
        assert first.getsockname()[1] != second.getsockname()[1]
    finally:
        first.close()
        second.close()
    with pytest.raises(ValueError):
        ListenerConfig(port_min=10, port_max=0)


def test_the_secret_never_shows_in_its_repr() -> None:
    s = RunSecret.new()
    assert s.value.hex() not in repr(s) and "hidden" in repr(s)
