"""The API holds under abuse: a flood of half-open sockets, dribbled heads and bodies,
garbage on the wire, and one account's burst of plans. Every test runs a real
``ito-backend serve`` (a subprocess) and attacks it over real sockets."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.backend import Backend, start_backend
from helpers.manifests import example_manifest, manifest_payload
from helpers.tenants import Tenant, make_tenant

from orchestrator.api.serving import LogRateLimit

HALF_OPEN = 4000
GARBAGE = 300
# The descriptor limit of the server under attack: a common default soft limit. The
# flood is four times what it allows.
SERVER_NOFILE = 1024
# Answers are awaited this long at most (a hung server fails the test, not a clock).
ANSWER_WAIT_S = 60.0
MB = 1 << 20


def _raise_own_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this host allows {hard} descriptors per process; the flood needs {need}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _connect(port: int, sel: selectors.BaseSelector | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    err = s.connect_ex(("127.0.0.1", port))
    assert err in (0, errno.EINPROGRESS, errno.EAGAIN), err
    if sel is not None:
        sel.register(s, selectors.EVENT_READ)
    return s


class Flood:
    """``n`` sockets that send nothing, held open; one the server closes is opened
    again (as an attacker would keep the pressure on)."""

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.sel = selectors.DefaultSelector()
        self.socks = [_connect(port, self.sel) for _ in range(n)]
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._churn, daemon=True)
        self._thread.start()

    def _churn(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                self.sel.unregister(s)
                s.close()
                self.socks.remove(s)
                if not self._stop.is_set():
                    self.socks.append(_connect(self.port, self.sel))
                    self.reopened += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.socks:
            s.close()
        self.sel.close()


def _garbage(port: int, n: int) -> None:
    """Requests h11 cannot parse: each one a protocol error the server may log."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WAIT_S) as s:
            s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
            with contextlib.suppress(OSError):
                s.recv(1024)


@pytest.fixture
def hostile_backend(tmp_path: Path) -> Iterator[Backend]:
    _raise_own_nofile(HALF_OPEN + 1024)
    b = start_backend(tmp_path / "backend", nofile=SERVER_NOFILE)
    try:
        yield b
    finally:
        b.stop()


@pytest.mark.slow
def test_half_open_sockets_and_garbage_neither_stop_service_nor_flood_the_log(
    hostile_backend: Backend,
) -> None:
    b = hostile_backend
    t = make_tenant(b.db, "acme")
    log_before = b.log_path.stat().st_size
    flood = Flood(b.port, HALF_OPEN)
    try:
        _garbage(b.port, GARBAGE)
        timings: dict[str, float] = {}
        with httpx.Client(base_url=b.url, timeout=ANSWER_WAIT_S) as client:
            t0 = time.perf_counter()
            health = client.get("/healthz")
            timings["healthz"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            runs = client.get(
                "/v1/runs",
                params={"idempotency_key": "no-such-key-1"},
                headers={"Authorization": f"Bearer {t.submitter}"},
            )
            timings["GET /v1/runs"] = time.perf_counter() - t0
        held, reopened = len(flood.socks), flood.reopened
    finally:
        flood.close()
    assert health.status_code == 200, health.text
    # Authenticated and looked up in the store: no run has that key.
    assert runs.status_code == 200 and runs.json()["data"] == {"runs": []}
    assert b.proc is not None and b.proc.poll() is None
    grew = b.log_path.stat().st_size - log_before
    log = b.log_text()
    invalid = log.count("Invalid HTTP request received")
    assert grew < 5 * MB
    # Rate limited: the default burst per kind and window, not one line per request.
    assert invalid <= 20, invalid
    print(
        f"\n{HALF_OPEN} half-open sockets held ({held} at the end, {reopened} reopened "
        f"after the server closed them), {GARBAGE} garbage requests, server limit "
        f"{SERVER_NOFILE} descriptors: "
        + ", ".join(f"{k} answered in {v:.3f} s" for k, v in timings.items())
        + f"; log grew {grew / 1024:.1f} KiB ({invalid} 'Invalid HTTP request' lines)"
    )


def _closed_by_server(s: socket.socket, wait_s: float, dribble: bytes = b"") -> bool:
    """Whether the server closes ``s`` within ``wait_s`` (sending ``dribble`` a byte
    a second meanwhile)."""
    s.settimeout(1.0)
    deadline = time.monotonic() + wait_s
    sent = 0
    while time.monotonic() < deadline:
        try:
            if sent < len(dribble):
                s.sendall(dribble[sent : sent + 1])
                sent += 1
            data = s.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return True  # reset
        if data == b"" or b"HTTP/1.1" in data:
            return True
    return False


@pytest.mark.slow
def test_idle_dribbling_and_slow_body_connections_are_closed(tmp_path: Path) -> None:
    b = start_backend(
        tmp_path / "backend", extra_args=["--header-timeout", "2", "--body-timeout", "3"]
    )
    try:
        wait = 30.0  # far beyond both timeouts
        idle = socket.create_connection(("127.0.0.1", b.port))
        dribbler = socket.create_connection(("127.0.0.1", b.port))
        slow_body = socket.create_connection(("127.0.0.1", b.port))
        slow_body.sendall(
            b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"booking_id": '
        )
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100
        results: dict[str, bool] = {}
        threads = [
            threading.Thread(
                target=lambda k=k, s=s, d=d: results.__setitem__(k, _closed_by_server(s, wait, d))
            )
            for k, s, d in (
                ("idle", idle, b""),
                ("dribbler", dribbler, head),
                ("body", slow_body, b""),
            )
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(wait + 10)
        for s in (idle, dribbler, slow_body):
            s.close()
        assert results == {"idle": True, "dribbler": True, "body": True}
        # A well-behaved client is still served, with keep-alive.
        with httpx.Client(base_url=b.url, timeout=ANSWER_WAIT_S) as client:
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 200
        assert "no complete request head within 2 s" in b.log_text()
        assert "no complete request body within 3 s" in b.log_text()
    finally:
        b.stop()


def _big_manifest(tmp: Path) -> dict[str, object]:
    m = example_manifest(tmp / "ckpt")
    m["notes"] = {"pad": "x" * (MB - 4096)}  # ~1 MiB; the model refuses the unknown field
    return m


@pytest.mark.slow
def test_one_accounts_burst_of_plans_is_bounded_and_another_account_is_served(
    tmp_path: Path,
) -> None:
    b = start_backend(tmp_path / "backend")
    try:
        noisy = make_tenant(b.db, "noisy")
        quiet = make_tenant(b.db, "quiet")
        payload = json.dumps(
            {"booking_id": noisy.booking_id, **manifest_payload(_big_manifest(tmp_path))}
        ).encode()
        answers: list[httpx.Response] = []
        errors: list[BaseException] = []
        burst = 24
        start = threading.Barrier(burst + 1)

        def plan(t: Tenant, body: bytes) -> httpx.Response:
            return httpx.post(
                b.url + "/v1/plans",
                content=body,
                headers={
                    "Authorization": f"Bearer {t.submitter}",
                    "Content-Type": "application/json",
                },
                timeout=ANSWER_WAIT_S,
            )

        def noisy_plan() -> None:
            try:
                start.wait()
                answers.append(plan(noisy, payload))
            except BaseException as e:
                errors.append(e)

        quiet_body = json.dumps(
            {"booking_id": quiet.booking_id, **manifest_payload(example_manifest(tmp_path / "q"))}
        ).encode()
        t0 = time.perf_counter()
        assert plan(quiet, quiet_body).status_code == 200
        alone_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert plan(noisy, payload).status_code == 422  # one big plan, alone
        big_s = time.perf_counter() - t0
        threads = [threading.Thread(target=noisy_plan) for _ in range(burst)]
        for th in threads:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        served = plan(quiet, quiet_body)
        quiet_s = time.perf_counter() - t0
        for th in threads:
            th.join(ANSWER_WAIT_S * 2)
        # Then a sustained flood (8 clients sending back to back): the account's key is
        # known, so what is beyond its bound is refused before its body is read.
        flooding = threading.Event()

        def flood() -> None:
            while not flooding.is_set():
                try:
                    answers.append(plan(noisy, payload))
                except BaseException as e:
                    errors.append(e)

        flooders = [threading.Thread(target=flood) for _ in range(8)]
        for th in flooders:
            th.start()
        sustained: list[float] = []
        quiet_answers = [served]
        for _ in range(5):
            t0 = time.perf_counter()
            quiet_answers.append(plan(quiet, quiet_body))
            sustained.append(time.perf_counter() - t0)
        flooding.set()
        for th in flooders:
            th.join(ANSWER_WAIT_S * 2)
        refused = [r for r in answers if r.status_code == 429]
        print(
            f"\n{burst} concurrent ~1 MiB plans from one account: the other account's plan "
            f"answered in {quiet_s:.3f} s (alone: {alone_s:.3f} s; one ~1 MiB plan alone: "
            f"{big_s:.3f} s); then 8 clients of that account back to back: the other's "
            f"plans answered in {', '.join(f'{x:.3f}' for x in sustained)} s; of the "
            f"account's {len(answers)} plans {len(refused)} were refused 429 "
            "too_many_concurrent_plans"
        )
        assert not errors, errors
        assert [r.status_code for r in quiet_answers] == [200] * 6, served.text
        codes = sorted(r.json()["error"]["code"] for r in answers)
        assert refused, codes
        assert {r.json()["error"]["code"] for r in refused} == {"too_many_concurrent_plans"}
        assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
        # What was not refused was validated in full (and refused by the model).
        assert {r.json()["error"]["code"] for r in answers if r.status_code != 429} <= {
            "manifest_invalid"
        }
    finally:
        b.stop()


def test_protocol_log_lines_are_limited_per_kind_and_the_dropped_ones_counted() -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("ito.test.protocol-log")
    logger.propagate = False
    logger.addHandler(Keep())
    logger.addFilter(LogRateLimit(burst=3, window_s=0.2))
    for _ in range(10):
        logger.warning("connection closed: no complete %s within %.0f s", "request head", 10)
    logger.warning("Invalid HTTP request received.")
    assert records == ["connection closed: no complete request head within 10 s"] * 3 + [
        "Invalid HTTP request received."
    ]
    time.sleep(0.25)  # the next window
    logger.warning("connection closed: no complete %s within %.0f s", "request head", 10)
    assert records[-1] == (
        "connection closed: no complete request head within 10 s "
        "[7 more like this in the last 0.2 s not logged]"
    )
