"""Free ports for the listeners this host starts: never the same one twice, which
would fail a Ray head whose dashboard and agent were given one port."""

from __future__ import annotations

import socket

from orchestrator.runtime.ports import free_port


def test_free_port_never_hands_out_a_port_twice_and_each_can_be_bound() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    for port in ports[-5:]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
