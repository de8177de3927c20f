"""Transport behaviour of the client on real loopback sockets: bounded timeouts,
classification of failures, retries of reads, no redirects, URL policy."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest
from client_proxy import RecordingProxy
from helpers.backend import free_port

from orchestrator.client.api import ItoClient
from orchestrator.client.cli import EXIT_TRANSPORT, run_cli
from orchestrator.client.credentials import ApiKey
from orchestrator.client.transport import ClientSettings, check_api_url
from stages.errors import ErrorCode

KEY = ApiKey("itok_t1_transportsecret", source="env")
# No backoff, so retries are immediate; the deadlines are generous (a loaded machine
# answers a 502 slowly too): only the total-timeout test below shortens its deadline,
# against servers that never finish answering.
FAST = ClientSettings(
    connect_timeout_s=10.0, total_timeout_s=30.0, retry_backoff_s=0.0, read_max_attempts=3
)
SHORT_TOTAL_TIMEOUT_S = 0.6


class _RawServer:
    """A loopback TCP server whose per-connection behaviour the test scripts."""

    def __init__(self, behaviour: str):
        self.behaviour = behaviour
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.connections = 0
        self.received = b""
        self.redirect_response = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            if self.behaviour == "redirect":
                with contextlib.suppress(TimeoutError):
                    self.received += conn.recv(65536)
                conn.sendall(self.redirect_response)
                return
            if self.behaviour == "slow_loris":
                # Headers, then a byte now and then, forever: each read is quick, so only
                # a total deadline can end the request.
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                while not self.stop.is_set():
                    try:
                        conn.sendall(b" ")
                    except OSError:
                        return
                    self.stop.wait(0.05)
            while not self.stop.is_set():  # "hang": read and never answer
                try:
                    if not conn.recv(65536):
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def raw_server(request: pytest.FixtureRequest) -> Iterator[_RawServer]:
    srv = _RawServer(request.param)
    yield srv
    srv.close()


def test_connection_refused_is_unreachable_and_not_live() -> None:
    with ItoClient(f"http://127.0.0.1:{free_port()}", KEY, settings=FAST) as c:
        env = c.run("r1")
        assert env["ok"] is False and env["live_api_contacted"] is False
        assert env["error"]["code"] == ErrorCode.api_unreachable
        assert c.requests_sent == FAST.read_max_attempts  # a refused read is retried, boundedly


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw_server", ["hang", "slow_loris"], indirect=True)
def test_total_timeout_bounds_the_whole_request(raw_server: _RawServer) -> None:
    settings = FAST.model_copy(
        update={"read_max_attempts": 1, "total_timeout_s": SHORT_TOTAL_TIMEOUT_S}
    )
    with ItoClient(f"http://127.0.0.1:{raw_server.port}", KEY, settings=settings) as c:
        env = c.run("r1")
    assert env["error"]["code"] == ErrorCode.api_timeout
    assert env["live_api_contacted"] is False


def test_non_envelope_502_read_is_retried_then_reported() -> None:
    with RecordingProxy(upstream_port=None) as proxy:  # no upstream: every answer is a 502
        with ItoClient(proxy.url, KEY, settings=FAST) as c:
            env = c.metrics("r1")
        assert env["error"]["code"] == ErrorCode.api_unreachable
        assert "502" in env["error"]["message"]
        assert len(proxy.matching("GET", "/v1/runs/r1/metrics")) == FAST.read_max_attempts


@pytest.mark.parametrize("raw_server", ["redirect"], indirect=True)
def test_redirect_is_not_followed_and_key_not_forwarded(raw_server: _RawServer) -> None:
    with RecordingProxy(upstream_port=None) as elsewhere:
        raw_server.redirect_response = (
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: "
            + elsewhere.url.encode()
            + b"/steal\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        with ItoClient(f"http://127.0.0.1:{raw_server.port}", KEY, settings=FAST) as c:
            env = c.run("r1")
        assert env["ok"] is False and "307" in env["error"]["message"]
        assert elsewhere.requests == []
    # The one server we asked did get the key; the redirect target got nothing.
    assert b"authorization: bearer itok_t1_" in raw_server.received.lower()


def test_path_segments_are_escaped() -> None:
    with RecordingProxy(upstream_port=None) as proxy:
        with ItoClient(
            proxy.url, KEY, settings=FAST.model_copy(update={"read_max_attempts": 1})
        ) as c:
            c.run("../../healthz?x=1")
        assert [r.path for r in proxy.requests] == ["/v1/runs/..%2F..%2Fhealthz%3Fx%3D1"]


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:8000/", True),
        ("http://[::1]:8000", True),
        ("https://api.example.com", True),
        ("http://api.example.com", False),
        ("http://10.0.0.5:8000", False),
        ("ftp://127.0.0.1", False),
        ("https://user:pw@api.example.com", False),
        ("https://api.example.com/?token=x", False),
        ("127.0.0.1:8000", False),
    ],
)
def test_api_url_policy(url: str, ok: bool) -> None:
    if ok:
        assert not check_api_url(url, {}).endswith("/")
    else:
        with pytest.raises(ValueError):
            check_api_url(url, {})


def test_insecure_http_override() -> None:
    assert check_api_url("http://10.0.0.5:8000", {"ITO_ALLOW_INSECURE_HTTP": "1"})


def test_cli_transport_failure_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ITO_API_KEY", KEY.reveal())
    argv = [
        "status",
        "--run",
        "r1",
        "--json",
        "--api-url",
        f"http://127.0.0.1:{free_port()}",
        "--connect-timeout",
        "0.5",
        "--timeout",
        "1",
    ]
    status, env = run_cli(
        argv,
        client_factory=lambda u, k, settings: ItoClient(
            u, k, settings=settings.model_copy(update={"retry_backoff_s": 0.0})
        ),
    )
    assert status == EXIT_TRANSPORT
    assert env["error"]["code"] == ErrorCode.api_unreachable
    assert capsys.readouterr().out.count("\n") == 1
