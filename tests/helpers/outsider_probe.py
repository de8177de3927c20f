"""What an outsider tries against a run's listeners, run inside the outsider's network
namespace (``tests/helpers/outsider.py``) with no secret.

``python tests/helpers/outsider_probe.py`` reads ``{"targets": [[host, port], ...],
"lighthouse": "http://host:port", "replicas": [id, ...]}`` on stdin and prints one JSON
object: per target, what a TCP connect, the lighthouse dashboard's
``POST /replica/<id>/kill`` (HTTP/1) and an HTTP/2 client preface with a SETTINGS frame
got back; then a fake quorum join and a fake heartbeat through torchft's own
``LighthouseClient`` at the lighthouse's address.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: ``stages``

# Hang guards of one probe, never speed claims.
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 3.0
TORCHFT_TIMEOUT = datetime.timedelta(seconds=5)

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def exchange(host: str, port: int, payload: bytes) -> dict[str, Any]:
    """Connect, send ``payload``, read what comes back before the peer closes or goes
    quiet. ``answer``: the first bytes back, as latin-1 text."""
    try:
        s = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        return {"connected": False, "error": f"{type(e).__name__}: {e}", "answer": ""}
    got = b""
    error = None
    with s:
        s.settimeout(READ_TIMEOUT_S)
        try:
            s.sendall(payload)
            while len(got) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    return {"connected": True, "error": error, "answer": got[:512].decode("latin-1")}


def kill_request(replica: str) -> bytes:
    return (
        f"POST /replica/{replica}/kill HTTP/1.1\r\nHost: lighthouse\r\n"
        "Content-Length: 0\r\nConnection: close\r\n\r\n"
    ).encode()


def fake_quorum(address: str, replicas: list[str]) -> dict[str, str]:
    from stages.trainer.fleet.lighthouse import rust_extension

    ext = rust_extension()
    out: dict[str, str] = {}
    try:
        client = ext.LighthouseClient(address, connect_timeout=TORCHFT_TIMEOUT)
        q = client.quorum(
            replica_id="intruder",
            timeout=TORCHFT_TIMEOUT,
            address="http://198.51.100.2:1",
            store_address="198.51.100.2:2",
            step=10**6,
            world_size=1,
        )
        out["quorum"] = f"JOINED quorum {q.quorum_id}"
    except Exception as e:
        out["quorum"] = f"refused: {type(e).__name__}: {e}"[:300]
    for replica in replicas[:1]:
        try:
            ext.LighthouseClient(address, connect_timeout=TORCHFT_TIMEOUT).heartbeat(
                replica, timeout=TORCHFT_TIMEOUT
            )
            out["heartbeat"] = f"ACCEPTED for {replica}"
        except Exception as e:
            out["heartbeat"] = f"refused: {type(e).__name__}: {e}"[:300]
    return out


def main() -> None:
    req = json.load(sys.stdin)
    replicas = list(req.get("replicas") or ["rg000"])
    results = []
    for host, port in req["targets"]:
        results.append(
            {
                "target": [host, port],
                "kill": [exchange(host, port, kill_request(r)) for r in replicas],
                "http2": exchange(host, port, HTTP2_PREFACE + EMPTY_SETTINGS),
            }
        )
    print(json.dumps({"targets": results, "lighthouse": fake_quorum(req["lighthouse"], replicas)}))


if __name__ == "__main__":
    main()
