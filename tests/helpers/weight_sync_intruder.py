"""A stranger on the cluster network that tries to take a run's weights from the
collective weight path: a process of its own, with the version's descriptor (as if
it had read it off the network) but not the run's secret.

    PYTHONPATH=tests python -m helpers.weight_sync_intruder < base64-pickled-descriptor

It tries, one after another: a raw connection that sends a rank and reads whatever
comes; the handshake with a key of its own; and joining as a torch ``TCPStore`` client
and gloo rank 1 (how the path's earlier ``TCPStore`` rendezvous was joined, which
received the weights). It prints one JSON line: what each attempt got, the most bytes
any connection read, and the digest of the weights if it rebuilt any (else null).
"""

from __future__ import annotations

import base64
import datetime
import json
import pickle
import secrets
import socket
import struct
import sys
from typing import Any

# Bound on each attempt (a listener that never answers must not hang the test).
ATTEMPT_TIMEOUT_S = 15.0
# Bound on the TCPStore join: its client retries a refused connection until this runs
# out, so a refused join always takes all of it. The verdict is not its outcome but the
# listener's refusals and the weights (none rebuilt): a join the listener admitted
# would show in both however the join then ended.
STORE_JOIN_TIMEOUT_S = 5.0
# The most a raw connection reads.
READ_LIMIT_BYTES = 64 << 20


def _read_all(sock: socket.socket) -> int:
    got = 0
    sock.settimeout(ATTEMPT_TIMEOUT_S)
    try:
        while got < READ_LIMIT_BYTES:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            got += len(chunk)
    except OSError:
        pass
    return got


def _raw(desc: Any) -> tuple[str, int]:
    with socket.create_connection((desc.host, desc.port), timeout=ATTEMPT_TIMEOUT_S) as s:
        s.sendall(struct.pack("!I", 1) + b"\0" * 92)  # a rank, then junk where a proof goes
        return "closed", _read_all(s)


def _wrong_key(desc: Any) -> tuple[str, int]:
    from stages.netsec import PeerRefused, prove_to_peer

    with socket.create_connection((desc.host, desc.port), timeout=ATTEMPT_TIMEOUT_S) as s:
        try:
            prove_to_peer(s, secrets.token_bytes(32), ATTEMPT_TIMEOUT_S)
        except PeerRefused as e:
            return f"refused: {e}", 0
        s.sendall(struct.pack("!I", 1))
        return "admitted", _read_all(s)


def _store_join(desc: Any) -> tuple[str, dict[str, Any] | None]:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=STORE_JOIN_TIMEOUT_S)
    store = dist.TCPStore(desc.host, desc.port, desc.world, is_master=False, timeout=timeout)
    pg: Any = dist.ProcessGroupGloo(dist.PrefixStore("weight-sync", store), 1, desc.world, timeout)
    flats = [torch.empty(n, dtype=getattr(torch, dt)) for dt, n in desc.buckets]
    for t in flats:
        pg.broadcast(t, 0).wait()
    from stages.post_training.weight_sync import unpack

    return "joined", unpack(flats, desc)


def main() -> None:
    desc = pickle.loads(base64.b64decode(sys.stdin.readline()))
    from stages.post_training.weight_sync import state_digest

    report: dict[str, Any] = {"attempts": {}, "max_bytes_read": 0, "weights_digest": None}
    for name, attempt in (("raw", _raw), ("wrong_key", _wrong_key)):
        try:
            outcome, got = attempt(desc)
        except Exception as e:
            outcome, got = f"{type(e).__name__}: {e}"[:200], 0
        report["attempts"][name] = outcome
        report["max_bytes_read"] = max(report["max_bytes_read"], got)
    try:
        outcome, state = _store_join(desc)
        if state is not None:
            report["weights_digest"] = state_digest(state)
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"[:200]
    report["attempts"]["store_join"] = outcome
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
