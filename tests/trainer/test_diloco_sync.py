"""``DiLoCoSync`` against real torchft: two replica groups (a Manager each, in threads
of this process, over a real lighthouse and gloo) take inner steps alone and, at the
turn's last one, sync to the outer Nesterov step of their mean pseudo-gradient; the
outer state a checkpoint holds loads back; a model splits into streaming fragments,
which sync in turn."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.ft_manager import one_rank_manager, run_groups

from stages.errors import ErrorCode, ItoError
from stages.replica_sync import ReplicaSync
from stages.run_secret import RunSecret
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.fleet.lighthouse import start_lighthouse
from stages.trainer.rank.diloco import DiLoCoSync, fragments_of

SYNC = ReplicaSync(mode="diloco", sync_every=3)
INNER_LR = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, g: int, step: int) -> None:
    opt.zero_grad()
    model(torch.full((4, 8), float(g + 1 + step))).square().mean().backward()
    opt.step()


def test_two_groups_take_inner_steps_alone_and_sync_to_the_outer_step_of_their_mean() -> None:
    cfg = FaultToleranceConfig(min_replica_groups=2)
    lighthouse = start_lighthouse(cfg, min_replicas=2)
    secret = RunSecret.new()
    models = [_model() for _ in range(2)]  # the same weights (seeded off the threads)
    start = [p.detach().clone() for p in models[0].parameters()]
    results: dict[int, dict[str, Any]] = {}

    def group(g: int) -> None:
        manager, _store = one_rank_manager(
            cfg, lighthouse.address(), group=g, secret=secret, sync_quorum=True
        )
        model = models[g]
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        sync = DiLoCoSync(manager, model, inner, SYNC)
        seen = []
        try:
            for step in range(SYNC.sync_every):
                sync.voted = None
                _inner_step(model, inner, g, step)
                seen.append((sync.current_step(), sync.voted, sync.mid_turn))
            results[g] = {
                "seen": seen,
                "trainers": sync._trainers(trained=True),
                "params": [p.detach().clone() for p in model.parameters()],
                "state": sync.state.state_dict(),
            }
            # The outer state a checkpoint holds loads back into a sync that lost it.
            for t in sync.torchft_fragment(0).original_parameters.values():
                t.zero_()
            for opt_state in sync.outer[0].state.values():
                opt_state["momentum_buffer"].zero_()
            sync.state.load_state_dict(results[g]["state"])
            results[g]["reloaded"] = sync.state.state_dict()
        finally:
            sync.close()
            manager.shutdown(wait=False)

    try:
        run_groups(2, group)
    finally:
        lighthouse.shutdown()
    for r in results.values():
        # Inner steps alone, then the turn's last one syncs (torchft's step 1 = 3 steps).
        assert r["seen"] == [(1, None, True), (2, None, True), (3, True, False)]
        assert r["trainers"] == 2
    # Both groups come out with the outer Nesterov step of their mean pseudo-gradient,
    # from the weights of the last sync (a fresh momentum buffer: the update is
    # (1 + momentum) x the mean pseudo-gradient).
    local = []
    for g in range(2):
        replay = _model()
        opt = torch.optim.SGD(replay.parameters(), lr=INNER_LR)
        for step in range(SYNC.sync_every):
            _inner_step(replay, opt, g, step)
        local.append([p.detach() for p in replay.parameters()])
    for i, s in enumerate(start):
        pseudo = s - (local[0][i] + local[1][i]) / 2
        expected = s - SYNC.outer_lr * (1 + SYNC.outer_momentum) * pseudo
        for g in range(2):
            torch.testing.assert_close(results[g]["params"][i], expected)
    for g in range(2):
        saved, reloaded = results[g]["state"], results[g]["reloaded"]
        for kind in ("original", "momentum"):
            for name, t in saved["fragment_0"][kind].items():
                assert torch.equal(reloaded["fragment_0"][kind][name], t), (kind, name)
        assert any(t.abs().sum() > 0 for t in saved["fragment_0"]["momentum"].values())


def test_a_model_splits_into_streaming_fragments_of_its_parameters_once_each() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    parts = fragments_of(model, 2)
    assert len(parts) == 2
    assert [id(p) for f in parts for p in f.parameters()] == [id(p) for p in model.parameters()]
    sizes = [sum(p.numel() for p in f.parameters()) for f in parts]
    assert sizes == [144, 144]  # about equal bytes, in parameter order
    assert fragments_of(model, 1) == [model]
    with pytest.raises(ItoError) as e:
        fragments_of(torch.nn.Linear(8, 8), 3)  # two tensors make no three fragments
    assert e.value.code is ErrorCode.plan_sync_invalid


def test_streaming_fragments_sync_in_turn_each_every_h_steps() -> None:
    """F = 2 of H = 4: a fragment syncs every H / F steps, in turn, so after each sync
    the groups agree on the fragment that synced and not on the other, which trained
    on their own data since its last sync."""
    sync_cfg = ReplicaSync(mode="diloco", sync_every=4, fragments=2)
    cfg = FaultToleranceConfig(min_replica_groups=2)
    lighthouse = start_lighthouse(cfg, min_replicas=2)
    secret = RunSecret.new()

    def deep() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])

    models = [deep() for _ in range(2)]
    seen: dict[int, list[tuple[int, bool | None, list[list[torch.Tensor]]]]] = {}

    def group(g: int) -> None:
        manager, _store = one_rank_manager(
            cfg, lighthouse.address(), group=g, secret=secret, sync_quorum=True
        )
        model = models[g]
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        sync = DiLoCoSync(manager, model, inner, sync_cfg)
        seen[g] = []
        try:
            for step in range(2 * sync_cfg.sync_every):
                sync.voted = None
                _inner_step(model, inner, g, step)
                frags = [[p.detach().clone() for p in f.parameters()] for f in sync.fragments]
                seen[g].append((sync.current_step(), sync.voted, frags))
        finally:
            sync.close()
            manager.shutdown(wait=False)

    try:
        run_groups(2, group)
    finally:
        lighthouse.shutdown()

    def agree(step: int, frag: int) -> bool:
        a, b = seen[0][step][2][frag], seen[1][step][2][frag]
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    for g in range(2):
        assert [s for s, _, _ in seen[g]] == list(range(1, 9))
        assert [v for _, v, _ in seen[g]] == [None, True] * 4  # a sync every H / F steps
    synced = []
    for step in (1, 3, 5, 7):  # after the 2nd, 4th, ... inner step
        [frag] = [f for f in range(2) if agree(step, f)]
        synced.append(frag)
    assert synced in ([0, 1, 0, 1], [1, 0, 1, 0])
