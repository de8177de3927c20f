"""Where a rank's torchft listeners stand: never a wildcard, ports from the
deployment's range, torchft's credential-less servers behind a front.

A rank opens three kinds of listener (the lighthouse is ``stages.trainer.fleet.lighthouse``):

- rank 0 of each replica group: the group's ``ManagerServer`` (torchft's Rust gRPC
  server: quorum, should_commit, checkpoint metadata, and a ``Kill`` RPC; it takes no
  credential). torchft hard-codes its bind to ``[::]:port``; ``manager_listeners``
  rebinds it to ``127.0.0.1:P`` and puts a front (``stages.netfront``) on the node's
  cluster address, same port: the run's nodes only, HTTP/2 only. A rank on the
  server's own node dials the loopback side directly, so the per-step quorum and
  commit calls take no proxy hop; only ranks of other nodes pass the front.
- rank 0 of each replica group: the group's torch ``TCPStore`` (torchft's
  ``manager_addr``, each quorum's gloo rendezvous, the in-group process group's).
  It cannot ask a client for a proof (torch's clients are C++), and a secret key
  prefix would hide nothing: the store answers ``list_keys`` to any client. So it
  gets the same front as the ManagerServer (the run's nodes only, any protocol) over
  a socket we bind on ``127.0.0.1:P`` and hand to torch (``master_listen_fd``).
- every rank: its heal server (``stages.trainer.rank.heal_transport``), which proves the
  run's secret both ways itself and binds the cluster address directly.
- every rank: gloo's pair listeners (the in-group process group, torchft's
  cross-group one per quorum). gloo binds the address of ``GLOO_SOCKET_IFNAME``'s
  interface, else whatever the hostname resolves to (``127.0.0.1`` here, any address
  elsewhere); ``gloo_on_cluster_address`` names the interface that holds the cluster
  address. Their ports are gloo's own (ephemeral) and they take no credential.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.netfront import (
    LOOPBACK,
    AllowList,
    FrontConfig,
    Served,
    normalize_ip,
    run_node_addresses,
    serve_behind_front,
)
from stages.netsec import cluster_address, listener_config
from stages.run_facts import PlacementFact

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

# Linux's ioctl for an interface's IPv4 address.
_SIOCGIFADDR = 0x8915


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode())
            )
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def gloo_on_cluster_address() -> None:
    """Make gloo's listeners in this process bind the node's cluster address: set
    ``GLOO_SOCKET_IFNAME`` to the interface that holds it, before any process group
    exists. A deployment's own setting is kept; an address on no interface (IPv6,
    or none found) leaves gloo's default."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    host = normalize_ip(cluster_address())
    for _index, name in socket.if_nameindex():
        if _ipv4_of(name) == host:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def _allowed(placement: PlacementFact | None) -> AllowList:
    return lambda: run_node_addresses(placement)


@dataclass
class GroupStore:
    """A replica group's TCPStore master and the front that publishes it."""

    store: TCPStore
    served: Served[TCPStore]

    @property
    def address(self) -> tuple[str, int]:
        """What the group's ranks and the other groups dial."""
        return self.served.host, self.served.port

    def close(self) -> None:
        self.served.close()


def host_group_store(placement: PlacementFact | None, front: FrontConfig) -> GroupStore:
    """The group's ``TCPStore`` master on ``127.0.0.1:P`` (a socket bound here, handed
    to torch, which then owns it), behind a front on the cluster address, port ``P``."""
    # Where it is defined: ``torch.distributed`` imports it without re-exporting it.
    from torch._C._distributed_c10d import TCPStore

    def start(port: int) -> TCPStore:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((LOOPBACK, port))
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
        fd = sock.detach()  # torch closes it with the store
        return TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)

    served = serve_behind_front(
        cluster_address(),
        listener_config(),
        start,
        allowed=_allowed(placement),
        cfg=front,
        http2_only=False,  # torch's store protocol, not gRPC
        name="group-store",
    )
    return GroupStore(store=served.backend, served=served)


class _FrontedManagerServer:
    """torchft's ManagerServer with its front: what ``Manager`` holds as ``_manager``
    (it calls ``address`` and ``shutdown`` only)."""

    def __init__(self, served: Served[Any]):
        self.served = served

    def address(self) -> str:
        return str(self.served.backend.address())

    def shutdown(self) -> None:
        self.served.close()
        self.served.backend.shutdown()


def _loopback_side(address: str, host: str) -> str:
    """A ManagerServer address on this node's cluster address, as its loopback side
    (the server binds ``127.0.0.1`` at its front's port); others as they are."""
    scheme, sep, rest = address.rpartition("//")
    target_host, _, port = rest.rpartition(":")
    if normalize_ip(target_host) == normalize_ip(host):
        return f"{scheme}{sep}{LOOPBACK}:{port}"
    return address


@contextlib.contextmanager
def manager_listeners(placement: PlacementFact | None, front: FrontConfig) -> Iterator[None]:
    """While torchft's ``Manager`` is constructed in this block, the ManagerServer it
    makes binds ``127.0.0.1:P`` behind a front on the cluster address (port ``P`` from
    the range) instead of torchft's hard-coded ``[::]:port``, and the ManagerClient it
    makes for its group's server dials the loopback side when that server is on this
    node.

    A narrow shim: torchft 0.2 takes a port but not a bind address, and calls both
    names with keyword arguments from its module globals. One Manager is built per
    process at a time (a rank's start-up), so swapping the globals is safe."""
    import torchft.manager as tm

    host = cluster_address()
    make_server, make_client = tm.ManagerServer, tm.ManagerClient

    def server(**kwargs: Any) -> _FrontedManagerServer:
        def start(port: int) -> Any:
            advertised = f"[{host}]" if ":" in host else host
            return make_server(**{**kwargs, "bind": f"{LOOPBACK}:{port}", "hostname": advertised})

        served = serve_behind_front(
            host,
            listener_config(),
            start,
            allowed=_allowed(placement),
            cfg=front,
            http2_only=True,
            name="manager",
        )
        return _FrontedManagerServer(served)

    def client(addr: str, **kwargs: Any) -> Any:
        return make_client(_loopback_side(addr, host), **kwargs)

    tm.ManagerServer, tm.ManagerClient = server, client
    try:
        yield
    finally:
        tm.ManagerServer, tm.ManagerClient = make_server, make_client
