"""The DAPO loss properties of the issue, each a test, on plain tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.post_training.admission import is_uniform
from stages.post_training.losses import (
    aggregate,
    dapo_token_loss,
    group_advantages,
    overlong_penalty,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-10, 10), min_size=2, max_size=8).map(lambda r: r),
        min_size=1,
        max_size=5,
    ).filter(lambda g: len({len(r) for r in g}) == 1),
    st.booleans(),
)
def test_group_advantages_have_zero_mean(groups: list[list[float]], scale: bool) -> None:
    adv = group_advantages(torch.tensor(groups, dtype=torch.float64), scale=scale)
    assert torch.allclose(
        adv.mean(dim=-1), torch.zeros(len(groups), dtype=torch.float64), atol=1e-9
    )


def _grad_at(ratio: float, adv: float) -> float:
    prox = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    loss = dapo_token_loss(
        logp,
        prox,
        prox,
        torch.tensor([adv]),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        is_truncation=None,
    )
    loss.sum().backward()
    assert logp.grad is not None
    return float(logp.grad.item())


@pytest.mark.parametrize("ratio", [1 + EPS_HIGH + 0.01, 1.5, 3.0])
def test_positive_advantage_no_gradient_beyond_clip_high(ratio: float) -> None:
    assert _grad_at(ratio, adv=1.0) == 0.0


@pytest.mark.parametrize("ratio", [0.5, 1.0, 1 + EPS_HIGH - 0.01])
def test_positive_advantage_gradient_below_clip_high(ratio: float) -> None:
    assert _grad_at(ratio, adv=1.0) < 0.0  # descending raises log p


@pytest.mark.parametrize("ratio", [1 - EPS_LOW - 0.01, 0.5, 0.1])
def test_negative_advantage_no_gradient_below_clip_low(ratio: float) -> None:
    assert _grad_at(ratio, adv=-1.0) == 0.0


@pytest.mark.parametrize("ratio", [1 - EPS_LOW + 0.01, 1.0, 2.0])
def test_negative_advantage_gradient_above_clip_low(ratio: float) -> None:
    assert _grad_at(ratio, adv=-1.0) > 0.0


def test_clip_higher_is_asymmetric() -> None:
    # 1.25 is clipped under symmetric 0.2 but still learns under clip-higher 0.28.
    assert _grad_at(1.25, adv=1.0) != 0.0
    assert 1 + EPS_LOW < 1.25


def test_token_level_aggregation_over_micro_batches_equals_full_batch() -> None:
    torch.manual_seed(0)
    b, t = 6, 9
    logp = torch.randn(b, t, requires_grad=True)
    prox, behav = logp.detach() + 0.1 * torch.randn(b, t), logp.detach() + 0.1 * torch.randn(b, t)
    adv = torch.randn(b)
    lengths = torch.tensor([1, 9, 4, 7, 2, 5])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    total = int(mask.sum())
    kw = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH}
    full = aggregate(dapo_token_loss(logp, prox, behav, adv, **kw), mask, total)
    (g_full,) = torch.autograd.grad(full, logp)
    parts = [
        aggregate(dapo_token_loss(logp[s], prox[s], behav[s], adv[s], **kw), mask[s], total)
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    micro = sum(parts)
    (g_micro,) = torch.autograd.grad(micro, logp)
    assert torch.allclose(full, micro, atol=1e-6)
    assert torch.allclose(g_full, g_micro, atol=1e-7)
    # Not the sequence-mean (GRPO) aggregation: long completions weigh more.
    seq_mean = ((dapo_token_loss(logp, prox, behav, adv, **kw) * mask).sum(1) / mask.sum(1)).mean()
    assert not torch.allclose(full, seq_mean)


def test_masked_and_truncated_tokens_get_zero_gradient() -> None:
    """The engine's loss on the batch its ranks train (``assemble``): the padding after a
    completion and a truncated completion (``mask_truncated_completions``) get none."""
    from pathlib import Path

    from stages.post_training.config import RLVRConfig
    from stages.post_training.grpo_objective import GRPOObjective, assemble
    from stages.post_training.rollout import RolloutGroup
    from stages.post_training.step_groups import step_groups
    from stages.trainer.config import GRPOSettings

    ref = {
        "uri": "file:///x.jsonl",
        "sha256": "0" * 64,
        "provenance": {"source": "s", "license": "MIT"},
    }
    cfg = RLVRConfig.model_validate(
        {
            "data": ref,
            "steps": 1,
            "group_size": 2,
            "max_completion_tokens": 8,
            "overlong_buffer_tokens": 2,
            "mask_truncated_completions": True,
        }
    )
    g = RolloutGroup(
        id=0,
        version=0,
        worker=0,
        prompt_ids=[1],
        completion_ids=[[5, 2], [5] * 8],
        behav_logp=[[0.0] * 2, [0.0] * 8],
        lengths=[2, 8],
        truncated=[False, True],
        rewards=[1.0, 0.0],
        task_rewards=[1.0, 0.0],
        gen_s=0.0,
    )
    batch = assemble(step_groups(0, [g], cfg, pad_id=0))
    # Row r, position t predicts completion token t (a one-token prompt): the rows are
    # 9 wide (prompt + the longest completion).
    logits = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0))
    logits.requires_grad_(True)
    objective = GRPOObjective(
        GRPOSettings(epsilon=EPS_LOW, epsilon_high=EPS_HIGH), Path("unused"), dp_rank=0, dp_world=1
    )
    loss = objective.loss_sum(logits, batch) / batch["mask"].sum()
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    learns = (logits.grad != 0).any(dim=-1)  # [row, position]
    assert learns[0, :2].all()  # real tokens learn
    assert not learns[0, 2:].any()  # padding after EOS: none
    assert not learns[1].any()  # the truncated completion: none


def test_decoupled_importance_weight_is_truncated() -> None:
    def grad(behav: float, cap: float | None) -> float:
        logp = torch.zeros(1, 1, requires_grad=True)
        loss = dapo_token_loss(
            logp,
            torch.zeros(1, 1),
            torch.full((1, 1), behav),
            torch.tensor([1.0]),
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            is_truncation=cap,
        )
        loss.sum().backward()
        assert logp.grad is not None
        return float(logp.grad.item())

    on_policy = grad(0.0, 2.0)
    # A sample the stale policy found less likely (prox/behav = e^0.5) is up-weighted ...
    assert grad(-0.5, 2.0) == pytest.approx(on_policy * math.exp(0.5), rel=1e-6)
    # ... but never beyond the truncation.
    assert grad(-5.0, 2.0) == pytest.approx(on_policy * 2.0, rel=1e-6)
    assert grad(-5.0, None) == pytest.approx(on_policy, rel=1e-6)


def test_overlong_penalty_endpoints() -> None:
    kw = {"max_tokens": 100, "buffer_tokens": 20, "factor": 2.5}
    assert overlong_penalty(50, **kw) == 0.0
    assert overlong_penalty(80, **kw) == 0.0
    assert overlong_penalty(90, **kw) == pytest.approx(-1.25)
    assert overlong_penalty(100, **kw) == pytest.approx(-2.5)
    assert overlong_penalty(130, **kw) == pytest.approx(-2.5)


def test_uniform_groups_are_detected() -> None:
    assert is_uniform([1.0, 1.0, 1.0])
    assert is_uniform([0.0, 0.0])
    assert not is_uniform([0.0, 1.0, 0.0])


def test_no_kl_term_by_default_and_k3_when_beta() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    base = dapo_token_loss(
        logp,
        logp.detach(),
        logp.detach(),
        torch.tensor([0.0]),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        ref_logp=torch.ones(1, 2),
    )
    assert float(base.detach().abs().sum()) == 0.0
    kl = dapo_token_loss(
        logp,
        logp.detach(),
        logp.detach(),
        torch.tensor([0.0]),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        ref_logp=torch.ones(1, 2),
        beta=0.1,
    )
    assert float(kl.detach().sum()) == pytest.approx(2 * 0.1 * (math.e - 1 - 1))
