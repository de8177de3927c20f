"""What every listener a run opens stands on: the node's cluster address, a port from the
operator's range, and a per-run secret its peers prove without sending it.

Itô is a shared cluster: any tenant's job and any login session can reach a compute
node's ports. So a run's listeners (the torchft lighthouse's front, the groups' stores
and ManagerServers, heal transfers, the RLVR weight sync) never bind a wildcard, take
their ports from ``ListenerConfig``'s range (the one a firewall rule or NetworkPolicy
opens between the booking's nodes), and admit a peer only after a mutual
challenge-response over the run's secret:

    server -> client: nonce_s (32 random bytes)
    client -> server: nonce_c, HMAC(key, "client" | nonce_s | nonce_c)
    server -> client: HMAC(key, "server" | nonce_s | nonce_c)     (only if the client's was right)

``key`` is derived from the run secret for one purpose (``RunSecret.derive``), so a
proof for the weight sync is no proof for a heal. The secret itself travels only
through Ray (actor arguments, token-authenticated), never on a listener's wire. The
server's answer lets the client refuse a fake server before it reads a byte of payload
(a heal never unpickles bytes from an unproven peer).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket

from pydantic import Field, model_validator

from stages.base import StrictModel
from stages.run_secret import RunSecret

__all__ = ["RunSecret"]  # re-exported: a listener's users take both from here

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size


class ListenerConfig(StrictModel):
    """Where a run's listeners bind and how long a peer has to prove itself."""

    # The range a deployment opens between a booking's nodes (deploy/k8s NetworkPolicy,
    # deploy/slurm's firewall rule). 0/0: any ephemeral port (a single-node testbed).
    port_min: int = Field(default=0, ge=0, le=65535)
    port_max: int = Field(default=0, ge=0, le=65535)
    # A peer that connects must finish the challenge-response within this; a half-open
    # connection from a stranger then holds a listener's thread no longer.
    handshake_timeout_s: float = Field(default=5.0, gt=0, le=60)

    @model_validator(mode="after")
    def _range(self) -> ListenerConfig:
        if (self.port_min == 0) != (self.port_max == 0) or self.port_min > self.port_max:
            raise ValueError("port_min..port_max must be a range, or both 0 for ephemeral")
        return self


# Set on every node by the deployment (deploy/k8s, deploy/slurm) to the range its
# NetworkPolicy or firewall rule opens between a booking's nodes: "MIN-MAX".
PORTS_ENV = "ITO_LISTEN_PORTS"


def listener_config() -> ListenerConfig:
    """This node's ``ListenerConfig``: the range in ``ITO_LISTEN_PORTS`` ("MIN-MAX"),
    ephemeral ports when it is unset (a single-node testbed)."""
    raw = os.environ.get(PORTS_ENV, "").strip()
    if not raw:
        return ListenerConfig()
    low, sep, high = raw.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"{PORTS_ENV} must be MIN-MAX, e.g. 42000-42999, not {raw!r}")
    return ListenerConfig(port_min=int(low), port_max=int(high))


class PeerRefused(ConnectionError):
    """The other side of a connection did not prove the run's secret."""


def cluster_address() -> str:
    """This node's address on the cluster network: the one Ray registered the node
    with (``RAY_NODE_IP_ADDRESS`` or Ray's own choice), never a wildcard."""
    explicit = os.environ.get("ITO_NODE_IP")
    if explicit:
        return explicit
    import ray

    if ray.is_initialized():
        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    return "127.0.0.1"


def bind_listener(host: str, cfg: ListenerConfig, *, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host`` and the first free port of the range."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports = [0] if cfg.port_min == 0 else list(range(cfg.port_min, cfg.port_max + 1))
    last: OSError | None = None
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(backlog)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise OSError(f"no free port on {host} in {cfg.port_min}..{cfg.port_max}: {last}")


def _mac(key: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(key, role + nonce_s + nonce_c, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ``ConnectionError`` if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def accept_peer(sock: socket.socket, key: bytes, timeout_s: float) -> None:
    """Server side: raise ``PeerRefused`` unless the peer proves ``key``. The socket's
    timeout is restored afterwards."""
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        nonce_s = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(nonce_s)
        reply = recv_exact(sock, NONCE_BYTES + MAC_BYTES)
        nonce_c, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(key, b"client", nonce_s, nonce_c)):
            raise PeerRefused("the peer did not prove the run's secret")
        sock.sendall(_mac(key, b"server", nonce_s, nonce_c))
    except (TimeoutError, OSError) as e:
        if isinstance(e, PeerRefused):
            raise
        raise PeerRefused(f"handshake failed: {e}") from e
    finally:
        sock.settimeout(previous)


def prove_to_peer(sock: socket.socket, key: bytes, timeout_s: float) -> None:
    """Client side: prove ``key`` and raise ``PeerRefused`` unless the server proves it
    back (a stranger posing as the server gets no payload request and sends none read)."""
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        nonce_s = recv_exact(sock, NONCE_BYTES)
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(nonce_c + _mac(key, b"client", nonce_s, nonce_c))
        answer = recv_exact(sock, MAC_BYTES)
        if not hmac.compare_digest(answer, _mac(key, b"server", nonce_s, nonce_c)):
            raise PeerRefused("the server did not prove the run's secret")
    except (TimeoutError, OSError) as e:
        if isinstance(e, PeerRefused):
            raise
        raise PeerRefused(f"handshake failed: {e}") from e
    finally:
        sock.settimeout(previous)
