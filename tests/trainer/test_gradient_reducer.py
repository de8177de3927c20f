"""The gradient reducer against real torchft: two replica groups (a Manager each, in
threads of this process, over a real lighthouse and gloo) reduce their gradients in
buckets launched during the backward, and end with the mean of both groups'
gradients and losses."""

from __future__ import annotations

from typing import Any

import torch
from helpers.ft_manager import one_rank_manager, run_groups

from stages.run_secret import RunSecret
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.fleet.lighthouse import start_lighthouse
from stages.trainer.rank import ft


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


def test_two_groups_reduce_buckets_during_the_backward_to_the_mean_of_both() -> None:
    cfg = FaultToleranceConfig(min_replica_groups=2)
    # Both groups in the first quorum (min_replicas 1 let the first to ask form one alone).
    lighthouse = start_lighthouse(cfg, min_replicas=2)
    secret = RunSecret.new()
    results: dict[int, dict[str, Any]] = {}
    models = [_model() for _ in range(2)]  # the same weights (seeded off the threads)

    def group(g: int) -> None:
        manager, _store = one_rank_manager(cfg, lighthouse.address(), group=g, secret=secret)
        model = models[g]
        reducer = ft.GradientReducer(manager, model.parameters(), bucket_bytes=16 * 16 * 4)
        votes = []
        try:
            for step in range(2):
                model.zero_grad(set_to_none=True)
                manager.start_quorum()
                x = torch.full((8, 16), float(g + 1 + step))
                loss = model(x).square().mean()
                reducer.arm()
                loss.backward()
                local = [p.grad.clone() for p in model.parameters()]
                in_flight = reducer.in_flight
                # Group 1 asks every group to stop after the second step.
                reduced = reducer.finish(loss, vote=1.0 if (g, step) == (1, 1) else 0.0)
                mean_loss = reduced.loss
                votes.append(reduced.vote)
                assert manager.should_commit()
            results[g] = {
                "local": local,
                "reduced": [p.grad.clone() for p in model.parameters()],
                "loss": float(loss),
                "mean_loss": mean_loss,
                "in_flight": in_flight,
                "votes": votes,
                "buckets": len(reducer.buckets),
                "participants": manager.num_participants(),
            }
        finally:
            reducer.close()
            manager.shutdown(wait=False)

    try:
        run_groups(2, group)
    finally:
        lighthouse.shutdown()
    a, b = results[0], results[1]
    assert a["participants"] == b["participants"] == 2
    # Every bucket but the last (it carries the loss) went out while the backward ran.
    assert a["buckets"] >= 3
    assert a["in_flight"] == b["in_flight"] == a["buckets"] - 1
    for ga, gb, ra, rb in zip(a["local"], b["local"], a["reduced"], b["reduced"], strict=True):
        assert not torch.equal(ga, gb)  # the groups' own gradients differ ...
        assert torch.equal(ra, rb)  # ... and both end with the same mean
        torch.testing.assert_close(ra, (ga + gb) / 2)
    assert a["mean_loss"] == b["mean_loss"]
    assert abs(a["mean_loss"] - (a["loss"] + b["loss"]) / 2) < 1e-5 * a["mean_loss"]
    # One group's ask to stop reaches both at the same step, with no round trip of its own.
    assert a["votes"] == b["votes"] == [0.0, 0.5]
