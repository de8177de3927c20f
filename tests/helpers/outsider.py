"""An outsider on the cluster network: a network namespace joined to this host by a veth
pair, so a probe run in it reaches the host's addresses as another tenant's job would,
from an address that is none of the run's nodes.

    host side   198.51.100.1/30  (the run's cluster address: ITO_NODE_IP, Ray's node IP)
    outsider    198.51.100.2/30  (default route via the host side: every host address)

TEST-NET-2 addresses only (RFC 5737): never routed, never another machine's. Needs root
and ``ip`` (iproute2); skips without them, fails instead where CI requires them
(``ITO_REQUIRE_ROOT=1``, ``ITO_REQUIRE_NETNS=1``: tests/helpers/tools.py). The
namespace and the veth pair are removed on exit, whatever happened; one outsider
network at a time on the host (a file lock), since both ends' addresses are fixed."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from helpers.tools import require, require_root

HOST_IP = "198.51.100.1"
OUTSIDER_IP = "198.51.100.2"
# How `ss` shows a listener bound to every address (a run listener must never be one).
WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})
PREFIX_LEN = 30
NAMESPACE_PREFIX = "ito-outsider-"
LOCK = os.path.join(tempfile.gettempdir(), "ito-tests-outsider.lock")
# A probe is a short script; a hang guard, never a speed claim.
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outsider:
    namespace: str
    ip: str = OUTSIDER_IP
    host_ip: str = HOST_IP

    def run(
        self, *argv: str, stdin_text: str | None = None, timeout_s: float = PROBE_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the namespace."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *argv],
            input=stdin_text,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=check)


def _remove(namespace: str, host_link: str) -> None:
    # Deleting the namespace deletes its veth end, and with it the host's peer; the
    # explicit link delete covers a namespace that never got its end.
    _ip("netns", "del", namespace, check=False)
    _ip("link", "del", host_link, check=False)


def _remove_stale() -> None:
    """Namespaces a killed test session left (its pid is in the name and gone)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NAMESPACE_PREFIX):
            continue
        pid = name.removeprefix(NAMESPACE_PREFIX)
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove(name, f"itoh{pid}")


@contextmanager
def outsider_network() -> Iterator[Outsider]:
    """The namespace and its veth pair, for the ``with`` block."""
    require("netns", "ip")
    require_root("an outsider network namespace and its veth pair")
    pid = os.getpid()
    namespace, host_link, peer_link = f"{NAMESPACE_PREFIX}{pid}", f"itoh{pid}", f"itoo{pid}"
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _remove_stale()
            try:
                try:
                    _ip("netns", "add", namespace)
                    _ip("link", "add", host_link, "type", "veth", "peer", "name", peer_link)
                    _ip("link", "set", peer_link, "netns", namespace)
                    _ip("addr", "add", f"{HOST_IP}/{PREFIX_LEN}", "dev", host_link)
                    _ip("link", "set", host_link, "up")
                    inside = ("netns", "exec", namespace, "ip")
                    _ip(*inside, "addr", "add", f"{OUTSIDER_IP}/{PREFIX_LEN}", "dev", peer_link)
                    _ip(*inside, "link", "set", peer_link, "up")
                    _ip(*inside, "link", "set", "lo", "up")
                    _ip(*inside, "route", "add", "default", "via", HOST_IP)
                except subprocess.CalledProcessError as e:
                    raise AssertionError(f"outsider network: {e.cmd}: {e.stderr}") from e
                yield Outsider(namespace)
            finally:
                _remove(namespace, host_link)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
