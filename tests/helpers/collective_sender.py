"""A learner's rank 0 on the collective weight path, in a process of its own, so a test
can kill it for real in the middle of a version.

    PYTHONPATH=tests python -m helpers.collective_sender --policy DIR --seed N [--die-after K]

It reads the run's weight-sync key (hex) from its first stdin line (a test's stand-in
for Ray's actor argument), perturbs the policy's weights with ``seed`` (as an
optimizer step would), opens a ``CollectiveSender`` for one worker on loopback, and
prints one line: the base64 pickle of ``(descriptor, state digest)``. Then it sends
the version and waits for a line on stdin before it exits (its listener must outlive
the receive); with ``--die-after K`` it writes the frame's header and K buckets and
SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import base64
import os
import pickle
import signal
import socket
import sys
from typing import Any

# Small buckets: the tiny policy goes in several, so a death can fall between two.
BUCKET_BYTES = 16 << 10
# How long the receiver's side may wait on this sender (the descriptor carries it).
TIMEOUT_S = 60.0


def _dying_frame(buckets: int) -> Any:
    """A frame writer that announces the whole version, writes ``buckets`` of its
    buckets and SIGKILLs this process: the worker is left waiting on the rest."""
    from stages.post_training import weight_sync as ws

    def send_frame(sock: socket.socket, tag: bytes, flats: list[Any], timeout_s: float) -> None:
        views = [ws._byte_view(t) for t in flats]
        sock.sendall(ws._FRAME.pack(tag, sum(len(v) for v in views)))
        for v in views[:buckets]:
            sock.sendall(v)
        os.kill(os.getpid(), signal.SIGKILL)

    return send_frame


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--die-after", type=int, default=None)
    args = ap.parse_args()
    key = bytes.fromhex(sys.stdin.readline().strip())

    import torch

    from stages.post_training import weight_sync
    from stages.post_training.hf_io import load_model
    from stages.post_training.weight_sync import CollectiveSender, state_digest

    torch.manual_seed(args.seed)
    model = load_model(args.policy)
    with torch.no_grad():
        for p in model.parameters():  # tied weights stay tied
            p.add_(torch.randn_like(p))
    state = dict(model.state_dict())
    sender = CollectiveSender(
        workers=1,
        key=key,
        host="127.0.0.1",
        device="cpu",
        bucket_bytes=BUCKET_BYTES,
        timeout_s=TIMEOUT_S,
    )
    desc = sender.describe(state)
    flats = sender.pack(state, desc)
    print(base64.b64encode(pickle.dumps((desc, state_digest(state)))).decode(), flush=True)
    if args.die_after is not None:
        weight_sync._send_frame = _dying_frame(args.die_after)  # type: ignore[assignment]
    sender.send(desc, flats)
    sender.flush(TIMEOUT_S)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
