"""A heal's bytes go only to a peer that proves the run's secret, and a rank loads only
from a server that proves it back, with ``weights_only``.

Real sockets and a real torchft ``Manager`` built the way a rank builds it
(``ft.build_manager``: torchft's Rust lighthouse on loopback, the group's store, a
gloo process group). The heal is driven through the Manager's own transport with the
calls torchft makes at a quorum (``send_checkpoint`` on the source,
``recv_checkpoint`` on the healing rank). Each attacker speaks whatever the transport
it faces expects (HTTP to torchft's default ``HTTPTransport``), so the tests also
fail against the old transport.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import socket
import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed._serialization import _streaming_save

from stages.netfront import FrontConfig
from stages.netsec import ListenerConfig, PeerRefused
from stages.run_secret import RunSecret
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.fleet.lighthouse import start_lighthouse
from stages.trainer.rank import ft
from stages.trainer.rank.heal_transport import HEAL_PURPOSE, HealTransport, fetch_heal_state
from stages.trainer.rank.rank_listeners import host_group_store
from stages.trainer.rank.shard_state import sharded_state

pytestmark = pytest.mark.timeout(300)

TIMEOUT = timedelta(seconds=10)  # a hang guard, never a speed claim
STEP = 3
# A value no other bytes of a heal contain: found in what an attacker got = leaked.
MARK = 1234.5678


def _model() -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    with torch.no_grad():
        model[0].bias.fill_(MARK)  # type: ignore[operator]
    return model, optim


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Rank 0 of replica group 0, built as a rank builds it, holding a trained model."""
    monkeypatch.setenv("ITO_NODE_IP", "127.0.0.1")
    monkeypatch.delenv("ITO_LISTEN_PORTS", raising=False)
    cfg = FaultToleranceConfig()
    lighthouse = start_lighthouse(cfg, bind="127.0.0.1:0")
    store = host_group_store(None, FrontConfig())
    model, optim = _model()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "loop": {"windows": []}}
    mgr = ft.build_manager(
        cfg,
        pg=ft.build_process_group(cfg, "cpu"),
        replica_group=0,
        rank=0,
        ranks_per_group=1,
        store_addr=store.address[0],
        store_port=store.address[1],
        lighthouse_addr=lighthouse.address(),
        load_state_dict=lambda _s: None,
        state_dict=lambda: state,
        secret=RunSecret(b"r" * 32),
        placement=None,
    )
    try:
        yield mgr
    finally:
        mgr.shutdown(wait=False)
        store.close()
        lighthouse.shutdown()


def _mark_bytes() -> bytes:
    return torch.full((4,), MARK).numpy().tobytes()


def _steal(metadata: str, step: int) -> bytes:
    """What a process without the secret gets from a heal source: an HTTP GET of the
    state (torchft's transport), or that and a 64-byte answer to whatever it is sent."""
    if metadata.startswith("http"):
        try:
            with urllib.request.urlopen(f"{metadata}{step}/full", timeout=10) as r:
                return bytes(r.read())
        except OSError:
            return b""
    host, _, port = metadata.rpartition(":")
    got = b""
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
        s.settimeout(10)
        with contextlib.suppress(OSError):
            s.sendall(b"\0" * 64 + step.to_bytes(8, "big"))
            while chunk := s.recv(65536):
                got += chunk
    return got


def test_a_peer_without_the_run_secret_gets_none_of_a_heals_bytes(manager: Any) -> None:
    transport = manager._checkpoint_transport
    # What torchft does when a peer needs recovery from this rank (manager.py).
    transport.send_checkpoint([1], STEP, manager._manager_state_dict(), TIMEOUT)
    metadata = transport.metadata()

    stolen = _steal(metadata, STEP)
    assert _mark_bytes() not in stolen, "a process without the secret got the weights"
    assert len(stolen) <= 32, f"the server said more than its challenge: {len(stolen)} bytes"
    # A process of another run (a secret, not this run's) is refused too.
    other = RunSecret(b"o" * 32).derive(HEAL_PURPOSE)
    with pytest.raises(PeerRefused):
        fetch_heal_state(other, metadata, STEP, timeout=TIMEOUT, handshake_timeout_s=5)
    # And the run's own peer gets the state, bit for bit.
    ours = RunSecret(b"r" * 32).derive(HEAL_PURPOSE)
    got = fetch_heal_state(ours, metadata, STEP, timeout=TIMEOUT, handshake_timeout_s=5)
    assert torch.equal(got["user"]["default"]["model"]["0.bias"], torch.full((16,), MARK))


class _Boom:
    """A pickle that runs code when loaded: it creates ``path``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


class _FakeHealSource:
    """A server posing as a heal source, without the secret: it answers an HTTP GET
    with a pickle that runs code, and a client that waits for a challenge with a made-up
    challenge, a made-up proof and the same pickle."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(0.5)
            try:
                first = conn.recv(4096)
            except TimeoutError:
                first = b""
            if first.startswith(b"GET"):
                head = b"HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n"
                conn.sendall(head + self.payload)
                return
            conn.settimeout(5)
            conn.sendall(b"n" * 32)  # a "challenge"
            conn.recv(64)  # the client's proof, unchecked
            conn.sendall(b"p" * 32 + b"OK" + self.payload)  # a made-up proof, then bytes

    def close(self) -> None:
        self.sock.close()


def test_a_fake_heal_source_cannot_make_a_rank_load_its_bytes(manager: Any, tmp_path: Path) -> None:
    transport = manager._checkpoint_transport
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    _streaming_save({"user": _Boom(marker), "torchft": {"step": STEP}}, buf)
    fake = _FakeHealSource(buf.getvalue())
    try:
        # The form of address the rank's transport takes from a quorum.
        own = transport.metadata()
        metadata = (
            f"http://127.0.0.1:{fake.port}/checkpoint/"
            if own.startswith("http")
            else f"127.0.0.1:{fake.port}"
        )
        # What torchft does on a healing rank, with a source address a quorum named.
        with pytest.raises(Exception) as refused:
            transport.recv_checkpoint(0, metadata, STEP, TIMEOUT)
    finally:
        fake.close()
    assert not marker.exists(), "the rank ran a fake heal source's pickle"
    assert isinstance(refused.value, PeerRefused), repr(refused.value)


def _equal_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_bits(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


@pytest.mark.parametrize("layout", ["whole", "sharded"])
def test_a_heal_state_arrives_bit_for_bit_under_weights_only(layout: str) -> None:
    """The state a rank heals with (loop.heal_state: model and AdamW state dicts, or
    the local shards; the loop's windows; torchft's counters) holds only what
    ``weights_only`` loads, and arrives bit for bit."""
    secret = RunSecret.new()
    model, optim = _model()
    user = (
        {"shards": sharded_state(model, optim)}
        if layout == "sharded"
        else {"model": model.state_dict(), "optim": optim.state_dict()}
    )
    user["loop"] = {"windows": [[4, 5], [9, 12]], "batches_committed": 6}
    state = {"user": {"default": user}, "torchft": {"step": STEP, "batches_committed": 6}}
    kw: dict[str, Any] = dict(host="127.0.0.1", timeout=TIMEOUT, max_connections=4)
    source = HealTransport(secret, ListenerConfig(), **kw)
    healing = HealTransport(secret, ListenerConfig(), **kw)
    try:
        source.send_checkpoint([1], STEP, state, TIMEOUT)
        got = healing.recv_checkpoint(0, source.metadata(), STEP, TIMEOUT)
        # A step the source does not serve is refused, not served stale.
        with pytest.raises(ConnectionError):
            healing.recv_checkpoint(0, source.metadata(), STEP + 1, TIMEOUT)
        source.disallow_checkpoint()
    finally:
        source.shutdown()
        healing.shutdown()
    assert _equal_bits(state, got)
