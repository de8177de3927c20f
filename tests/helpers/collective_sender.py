"""A learner's rank 0 on the collective weight path, in a process of its own, so a test
can kill it for real in the middle of a broadcast.

    PYTHONPATH=tests python -m helpers.collective_sender --policy DIR --seed N [--die-after K]

It perturbs the policy's weights with ``seed`` (as an optimizer step would), opens a
``CollectiveSender`` for one worker, and prints one line: the base64 pickle of
``(descriptor, state digest)``. Then it broadcasts every bucket and waits for a line on
stdin before it exits (its store must outlive the receive); with ``--die-after K`` it
broadcasts K buckets and SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import base64
import os
import pickle
import signal
import sys

# Small buckets: the tiny policy goes in several, so a death can fall between two.
BUCKET_BYTES = 16 << 10
# How long the receiver's side may wait on this sender (the descriptor carries it).
TIMEOUT_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--die-after", type=int, default=None)
    args = ap.parse_args()

    import torch

    from stages.post_training.hf_io import load_model
    from stages.post_training.weight_sync import CollectiveSender, state_digest

    torch.manual_seed(args.seed)
    model = load_model(args.policy)
    with torch.no_grad():
        for p in model.parameters():  # tied weights stay tied
            p.add_(torch.randn_like(p))
    state = dict(model.state_dict())
    sender = CollectiveSender(
        workers=1, host="127.0.0.1", device="cpu", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S
    )
    desc = sender.describe(state)
    flats = sender.pack(state, desc)
    print(base64.b64encode(pickle.dumps((desc, state_digest(state)))).decode(), flush=True)
    if args.die_after is not None:
        sender.send(flats[: args.die_after])
        sender.flush(TIMEOUT_S)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-version: the worker waits on the rest
    sender.send(flats)
    sender.flush(TIMEOUT_S)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
