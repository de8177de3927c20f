"""A front for a listener a run cannot close itself: a TCP proxy on the node's cluster
address that admits only the run's own nodes and, for a gRPC server, only HTTP/2.

torchft's Rust servers (the lighthouse, each group's ManagerServer) take no
credential and the lighthouse serves an HTTP/1 dashboard with ``POST
/replica/<id>/kill`` on its gRPC port. The front closes them to outsiders without
touching torchft:

- the Rust server binds ``127.0.0.1:P``; the front binds ``<cluster address>:P``, the
  same port on another local address, so the address the server advertises (its
  hostname and bound port) still names the front;
- a connection is admitted only from an address of the run's nodes (``allowed``,
  re-read at most every ``allowlist_refresh_s`` when a stranger knocks: a bundle
  rescheduled onto a new node is admitted after that);
- with ``http2_only`` its first bytes must be the HTTP/2 client preface (gRPC always
  sends it first); anything else (an HTTP/1 request such as the dashboard's kill) is
  closed before a byte reaches the server;
- bounded: ``max_connections`` at once, ``preface_timeout_s`` to send the preface, reads
  of ``chunk_bytes`` with the writer drained before the next (no unbounded buffer);
  refusals are logged at most once per ``refusal_log_interval_s`` per reason.

Use::

    from stages.netfront import FrontConfig, serve_behind_front

    served = serve_behind_front(
        cluster_address(), listener_cfg,
        lambda port: RustServer(bind=f"127.0.0.1:{port}"),  # must bind exactly there
        allowed=lambda: run_node_addresses(ctx.facts.placement),
        cfg=FrontConfig(), http2_only=True, name="lighthouse",
    )
    served.backend   # the server; served.address: "host:port" that peers dial
    served.close()   # stops the front (the caller stops its server)

When the cluster address is loopback (a single-node testbed) there is no front: the
server binds the loopback address itself and only local processes reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import Field

from stages.base import StrictModel
from stages.netsec import ListenerConfig
from stages.run_facts import PlacementFact

log = logging.getLogger(__name__)

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
LOOPBACK = "127.0.0.1"

T = TypeVar("T")
AllowList = Callable[[], Iterable[str]]


class FrontConfig(StrictModel):
    """Bounds of one front (every run listener behind one has its own)."""

    # Connections held at once. A run's peers keep a few long-lived HTTP/2 connections
    # each (a Manager holds one to the lighthouse, one to each peer it heals from), so
    # this is far above a real run's need and keeps a flood from exhausting the
    # process's file descriptors.
    max_connections: int = Field(default=512, ge=1, le=65536)
    # An admitted peer must send the HTTP/2 preface within this (a gRPC client sends
    # it at once); a half-open connection holds a slot no longer.
    preface_timeout_s: float = Field(default=5.0, gt=0, le=120)
    # Connecting to the server behind the front (on the same host: instant unless the
    # server is gone, and then the peer should learn so promptly).
    backend_connect_timeout_s: float = Field(default=5.0, gt=0, le=120)
    # Bytes read per direction before the writer is drained: the most one connection
    # buffers per direction (plus the transport's own high-water mark).
    chunk_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 2**20)
    # One log line per refusal reason at most this often (with the count since): a
    # port scan or a flood must not fill the log.
    refusal_log_interval_s: float = Field(default=10.0, gt=0, le=3600)
    # A stranger's connection re-reads the allowlist at most this often (a bundle Ray
    # moved to a new node is admitted after it; a flood of strangers costs one lookup
    # per interval).
    allowlist_refresh_s: float = Field(default=5.0, gt=0, le=3600)
    # Ports tried when the server cannot bind the loopback side of a port the front
    # took (another process holds 127.0.0.1:P).
    bind_attempts: int = Field(default=16, ge=1, le=1024)
    # stop(): how long to wait for the front's thread to end.
    stop_timeout_s: float = Field(default=5.0, gt=0, le=120)


def normalize_ip(addr: str) -> str:
    """``addr`` in the form peers are compared in (IPv4-mapped IPv6 as IPv4)."""
    try:
        ip = ipaddress.ip_address(addr.strip("[]").split("%", 1)[0])
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(normalize_ip(addr)).is_loopback
    except ValueError:
        return addr == "localhost"


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (what a URL or gRPC target takes)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_node_addresses(placement: PlacementFact | None) -> set[str]:
    """The addresses (as Ray registered them) of the nodes that hold a bundle of the
    run's reservations (``reserved_node_ids``); every alive Ray node when the run has
    no placement (a stage run alone). Needs Ray initialised in this process."""
    import ray

    registered: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    alive = {n["NodeID"]: n["NodeManagerAddress"] for n in registered if n.get("Alive")}
    p = placement
    if p is None:
        return {normalize_ip(a) for a in alive.values()}
    from ray.util import placement_group_table

    nodes = reserved_node_ids(placement_group_table(), p.placement_group, p.placement_group_id)
    return {normalize_ip(alive[n]) for n in nodes if n in alive}


def reserved_node_ids(
    table: Mapping[str, Mapping[str, Any]], group_name: str, group_id: str
) -> set[str]:
    """The nodes of ``table`` (Ray's placement group table) that hold a bundle of the
    group ``group_id`` (named ``group_name``) or of another live reservation of the same
    run: its own group and the groups of nodes its booking gained while it trains. The
    ranks of a group added on a gained node and the run's others reach each other (and
    the lighthouse) through these fronts, so each admits the other's nodes."""
    from stages.placement import run_group_of

    run = run_group_of(group_name)
    nodes: set[str] = set()
    for group in table.values():
        ours = group.get("placement_group_id") == group_id or (
            group.get("state") != "REMOVED" and run_group_of(str(group.get("name", ""))) == run
        )
        if ours:
            nodes.update(str(n) for n in (group.get("bundles_to_node_id") or {}).values())
    return nodes


class _RefusalLog:
    """One line per reason per interval, with how many were refused since."""

    def __init__(self, name: str, interval_s: float):
        self.name = name
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def refused(self, reason: str, peer: str) -> None:
        now = time.monotonic()
        self._since[reason] = self._since.get(reason, 0) + 1
        if now - self._last.get(reason, -self.interval_s) >= self.interval_s:
            log.warning(
                "%s front refused %d connection(s) (%s), the latest from %s",
                self.name,
                self._since[reason],
                reason,
                peer,
            )
            self._last[reason] = now
            self._since[reason] = 0


class Front:
    """The proxy on one listening socket; ``start`` serves it in a thread of its own."""

    REASONS = ("address", "limit", "preface_timeout", "protocol", "backend")

    def __init__(
        self,
        sock: socket.socket,
        *,
        backend: tuple[str, int],
        allowed: AllowList,
        cfg: FrontConfig,
        http2_only: bool,
        name: str,
    ):
        self.sock = sock
        self.backend = backend
        self.cfg = cfg
        self.http2_only = http2_only
        self.name = name
        self._allowed_fn = allowed
        own = normalize_ip(sock.getsockname()[0])
        self._own = {own}  # the node itself is always one of the run's nodes
        self._allowed: set[str] = set(self._own)
        self._refreshed_at = -float("inf")
        self._active = 0
        self._refusals = _RefusalLog(name, cfg.refusal_log_interval_s)
        self.counts: dict[str, int] = {"admitted": 0, **{r: 0 for r in self.REASONS}}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def host(self) -> str:
        return str(self.sock.getsockname()[0])

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def stats(self) -> dict[str, int]:
        """Connections admitted and refused by reason, since the start."""
        return {**self.counts, "active": self._active}

    def start(self) -> Front:
        self._refresh_allowed()  # the first lookup before any peer waits on it
        self._thread = threading.Thread(target=self._serve, name=f"front-{self.name}", daemon=True)
        self._thread.start()
        self._ready.wait(self.cfg.stop_timeout_s)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # already stopping
                loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(self.cfg.stop_timeout_s)
        self.sock.close()

    # --- the loop ---------------------------------------------------------------------
    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._handle, sock=self.sock, limit=self.cfg.chunk_bytes)
            )
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _refresh_allowed(self) -> None:
        self._refreshed_at = time.monotonic()
        try:
            fresh = {normalize_ip(a) for a in self._allowed_fn()}
        except Exception as e:  # keep the last list: the run's nodes did not vanish
            log.warning("%s front: the run's node addresses could not be read: %s", self.name, e)
            return
        self._allowed = fresh | self._own

    async def _admits(self, ip: str) -> bool:
        if ip in self._allowed:
            return True
        if time.monotonic() - self._refreshed_at >= self.cfg.allowlist_refresh_s:
            self._refreshed_at = time.monotonic()  # one lookup per interval, not per knock
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._refresh_allowed)
        return ip in self._allowed

    def _refuse(self, reason: str, peer: str, writer: asyncio.StreamWriter) -> None:
        self.counts[reason] += 1
        self._refusals.refused(reason, peer)
        writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?",)
        ip = normalize_ip(str(peer[0]))
        if self._active >= self.cfg.max_connections:
            self._refuse("limit", ip, writer)
            return
        self._active += 1
        try:
            await self._admit_and_pipe(ip, reader, writer)
        except asyncio.CancelledError:  # the front stops: end quietly (asyncio's stream
            writer.transport.abort()  # callback reports a cancelled handler as an error)
        finally:
            self._active -= 1

    async def _admit_and_pipe(
        self, ip: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if not await self._admits(ip):
            self._refuse("address", ip, writer)
            return
        head = b""
        if self.http2_only:
            try:
                head = await asyncio.wait_for(self._preface(reader), self.cfg.preface_timeout_s)
            except TimeoutError:
                self._refuse("preface_timeout", ip, writer)
                return
            if head != HTTP2_PREFACE:
                self._refuse("protocol", ip, writer)
                return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.backend, limit=self.cfg.chunk_bytes),
                self.cfg.backend_connect_timeout_s,
            )
        except (OSError, TimeoutError):
            self._refuse("backend", ip, writer)
            return
        self.counts["admitted"] += 1
        if head:
            up_writer.write(head)
        pipes = [
            asyncio.ensure_future(self._pipe(reader, up_writer)),
            asyncio.ensure_future(self._pipe(up_reader, writer)),
        ]
        try:
            await asyncio.gather(*pipes)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for p in pipes:
                p.cancel()
            for w in (writer, up_writer):
                w.transport.abort()

    @staticmethod
    async def _preface(reader: asyncio.StreamReader) -> bytes:
        """The first bytes, up to the preface's length; returns early at the first byte
        that differs from it (an HTTP/1 request is refused at once)."""
        buf = b""
        while len(buf) < len(HTTP2_PREFACE):
            chunk = await reader.read(len(HTTP2_PREFACE) - len(buf))
            if not chunk:
                return buf
            buf += chunk
            if not HTTP2_PREFACE.startswith(buf):
                return buf
        return buf

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(self.cfg.chunk_bytes):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            with contextlib.suppress(OSError):
                dst.write_eof()


@dataclass
class Served(Generic[T]):
    """A server and the front that publishes it (None: the server binds a loopback
    cluster address itself)."""

    backend: T
    host: str
    port: int
    front: Front | None = field(default=None)

    @property
    def address(self) -> str:
        """``host:port`` the run's peers dial."""
        return host_port(self.host, self.port)

    def close(self) -> None:
        if self.front is not None:
            self.front.stop()


def _ports(listener: ListenerConfig) -> Iterable[int]:
    if listener.port_min == 0:
        while True:
            yield 0
    yield from range(listener.port_min, listener.port_max + 1)


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def serve_behind_front(
    host: str,
    listener: ListenerConfig,
    start_backend: Callable[[int], T],
    *,
    allowed: AllowList,
    cfg: FrontConfig,
    http2_only: bool,
    name: str,
) -> Served[T]:
    """Bind ``host:P`` (``P`` from ``listener``'s range), start the server with
    ``start_backend(P)`` (it must bind ``127.0.0.1:P`` and raise when it cannot), then
    serve the front. A port whose loopback side is taken is given up for the next one,
    ``cfg.bind_attempts`` times at most. With a loopback ``host`` the server alone binds
    ``127.0.0.1:P`` (no front)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        raise ValueError("a run's listener never binds a wildcard address")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last: BaseException | None = None
    attempts = 0
    for port in _ports(listener):
        if attempts >= cfg.bind_attempts:
            break
        attempts += 1
        if is_loopback(host):
            try:
                p = port or _free_loopback_port()
                return Served(backend=start_backend(p), host=LOOPBACK, port=p)
            except Exception as e:  # the port is taken: the next one
                last = e
                continue
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host.strip("[]"), port))
            sock.listen(min(cfg.max_connections, socket.SOMAXCONN))
        except OSError as e:
            sock.close()
            last = e
            continue
        bound = int(sock.getsockname()[1])
        try:
            backend = start_backend(bound)
        except Exception as e:
            sock.close()
            last = e
            continue
        front = Front(
            sock,
            backend=(LOOPBACK, bound),
            allowed=allowed,
            cfg=cfg,
            http2_only=http2_only,
            name=name,
        )
        front.start()
        return Served(backend=backend, host=host.strip("[]"), port=bound, front=front)
    raise OSError(
        f"{name}: no port in {listener.port_min}..{listener.port_max} free on both {host} "
        f"and {LOOPBACK} after {attempts} tries: {last}"
    )
