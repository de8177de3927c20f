"""The front of a run listener: only the run's addresses, only HTTP/2, bounded.

Real sockets on the loopback network (127.0.0.1 is the front's own address, always
admitted; a client bound to 127.0.0.2 plays a stranger) and a real echo server behind
the front."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from helpers.waiting import wait_until

from stages.netfront import HTTP2_PREFACE, Front, FrontConfig, serve_behind_front
from stages.netsec import ListenerConfig, listener_config

STRANGER = "127.0.0.2"
IO_TIMEOUT_S = 10.0  # hang guard of one socket read


class Echo:
    """A server that echoes and records every byte it received."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.received = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += data
                conn.sendall(data)


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.sock.close()


def _front(echo: Echo, allowed: list[str] | None = None, **cfg: float) -> Front:
    sock = socket.create_server(("127.0.0.1", 0))
    return Front(
        sock,
        backend=("127.0.0.1", echo.port),
        allowed=lambda: allowed or [],
        cfg=FrontConfig(**cfg),  # type: ignore[arg-type]
        http2_only=True,
        name="test",
    ).start()


def _dial(front: Front, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(IO_TIMEOUT_S)
    s.bind((source, 0))
    s.connect((front.host, front.port))
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the front closed the connection (EOF or reset) without a byte."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_http2_from_the_run_passes_both_ways(echo: Echo) -> None:
    front = _front(echo)
    try:
        with _dial(front) as s:
            s.sendall(HTTP2_PREFACE + b"frames")
            got = b""
            while len(got) < len(HTTP2_PREFACE) + 6:
                got += s.recv(100)
            assert got == HTTP2_PREFACE + b"frames"
        assert front.stats()["admitted"] == 1
    finally:
        front.stop()


def test_an_http1_request_is_closed_before_a_byte_reaches_the_server(echo: Echo) -> None:
    front = _front(echo)
    try:
        with _dial(front) as s:
            s.sendall(b"POST /replica/rg0/kill HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            assert _closed(s)
        # Even a short request that is a prefix of nothing is refused at its first byte.
        with _dial(front) as s:
            s.sendall(b"G")
            assert _closed(s)
        assert echo.connections == 0 and not echo.received
        assert front.stats()["protocol"] == 2
    finally:
        front.stop()


def test_a_stranger_is_closed_before_it_may_send(echo: Echo) -> None:
    front = _front(echo, allowed=["198.51.100.7"])
    try:
        with _dial(front, STRANGER) as s:
            s.sendall(HTTP2_PREFACE)
            assert _closed(s)
        assert echo.connections == 0
        assert front.stats()["address"] == 1
    finally:
        front.stop()


def test_a_listed_address_is_admitted(echo: Echo) -> None:
    front = _front(echo, allowed=[STRANGER])
    try:
        with _dial(front, STRANGER) as s:
            s.sendall(HTTP2_PREFACE)
            assert s.recv(100)
    finally:
        front.stop()


def test_a_silent_peer_is_closed_at_the_preface_deadline(echo: Echo) -> None:
    front = _front(echo, preface_timeout_s=0.3)
    try:
        with _dial(front) as s:
            assert _closed(s)
        assert front.stats()["preface_timeout"] == 1 and echo.connections == 0
    finally:
        front.stop()


def test_connections_beyond_the_limit_are_refused_and_the_slots_come_back(echo: Echo) -> None:
    front = _front(echo, max_connections=2)
    held = [_dial(front), _dial(front)]
    try:
        for s in held:
            s.sendall(HTTP2_PREFACE)
            assert s.recv(100)
        with _dial(front) as extra:
            assert _closed(extra)
        assert front.stats()["limit"] == 1
        for s in held:
            s.close()
        wait_until(lambda: front.stats()["active"] == 0, 10.0, "the held slots to free")
        with _dial(front) as again:
            again.sendall(HTTP2_PREFACE)
            assert again.recv(100)
    finally:
        for s in held:
            s.close()
        front.stop()


def test_a_burst_of_refusals_logs_one_line(echo: Echo, caplog: pytest.LogCaptureFixture) -> None:
    front = _front(echo)
    try:
        for _ in range(20):
            with _dial(front) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert _closed(s)
        lines = [r for r in caplog.records if "front refused" in r.getMessage()]
        assert len(lines) == 1
    finally:
        front.stop()


def test_serve_behind_front_puts_the_server_on_loopback_at_the_front_port() -> None:
    """The front on a non-loopback local address, the server on 127.0.0.1, the same port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # the source address of the default route (a UDP connect sends nothing)
            probe.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("this host has no route off loopback to put a front on")
        host = probe.getsockname()[0]
    bound: list[socket.socket] = []

    def start(port: int) -> socket.socket:
        s = socket.create_server(("127.0.0.1", port))
        bound.append(s)
        return s

    served = serve_behind_front(
        host, ListenerConfig(), start, allowed=list, cfg=FrontConfig(), http2_only=True, name="t"
    )
    try:
        assert served.front is not None
        assert served.backend.getsockname() == ("127.0.0.1", served.port)
        assert served.front.sock.getsockname() == (host, served.port)
    finally:
        served.close()
        for s in bound:
            s.close()


def test_a_wildcard_host_is_refused() -> None:
    with pytest.raises(ValueError, match="wildcard"):
        serve_behind_front(
            "0.0.0.0",
            ListenerConfig(),
            lambda p: p,
            allowed=list,
            cfg=FrontConfig(),
            http2_only=True,
            name="t",
        )


def test_a_loopback_host_has_no_front_and_a_taken_port_is_skipped() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    base = taken.getsockname()[1]
    ports: list[int] = []

    def start(port: int) -> int:
        ports.append(port)
        socket.create_server(("127.0.0.1", port)).close()  # raises on the taken one
        return port

    try:
        served = serve_behind_front(
            "127.0.0.1",
            ListenerConfig(port_min=base, port_max=base + 3),
            start,
            allowed=list,
            cfg=FrontConfig(),
            http2_only=True,
            name="t",
        )
    finally:
        taken.close()
    assert served.front is None and served.port == ports[-1] != base and ports[0] == base


def test_the_port_range_comes_from_the_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ITO_LISTEN_PORTS", raising=False)
    assert listener_config() == ListenerConfig()
    monkeypatch.setenv("ITO_LISTEN_PORTS", "42000-42099")
    assert (listener_config().port_min, listener_config().port_max) == (42000, 42099)
    monkeypatch.setenv("ITO_LISTEN_PORTS", "42000")
    with pytest.raises(ValueError, match="MIN-MAX"):
        listener_config()
