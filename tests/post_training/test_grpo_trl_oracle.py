"""Our GRPO/DAPO loss against trl's, where trl has the setting.

The oracle is trl 1.16's own ``GRPOTrainer._compute_loss`` on a real trainer built
around a tiny policy object that our loss is taken on too: same prompt and completion
ids, same masks, same advantages, same old / behaviour log-probs, and we compare the
loss and every parameter gradient. The engine's objective (``GRPOObjective.loss_sum``
on the batch ``assemble`` builds) is compared whole; each setting below is also
compared on the loss functions it is built from (``stages.post_training.losses``).
Settings trl has and that are compared here:

- ``loss_type="dapo"``: token sum over the accumulation window / its token count
  (``num_items_in_batch``), so trl's one micro-batch per group sums to the full-batch
  loss the engine takes in one forward; ``"bnpo"`` equals ours on a single micro-batch
  only;
- ``epsilon`` / ``epsilon_high`` (clip-higher), with an old policy that moved enough
  for both clip bounds to bite;
- ``beta=0`` (no KL) and, for the k3 term, ``beta > 0`` with
  ``use_bias_correction_kl=False`` (trl's default reweights the KL gradient);
- importance sampling: our decoupled correction (ratio to the proximal policy, weight
  prox/behaviour truncated) is trl's ``token_truncate`` correction with
  ``vllm_importance_sampling_clip_max`` = our ``is_truncation`` (trl names it after
  vLLM; the formula does not care who sampled);
- group advantages (mean-centred, over std + 1e-4).

Where trl has no equivalent, the test says so and checks the formula instead:
overlong shaping (trl ships the soft punishment as a reward function only, with no
factor; our ``overlong_penalty`` wraps it, so it is checked against DAPO's eq. 13) and
dynamic sampling (trl 1.16 only logs ``frac_reward_zero_std``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stages.post_training.config import RLVRConfig
from stages.post_training.fleet import DynamicSampler
from stages.post_training.losses import (
    aggregate,
    dapo_token_loss,
    group_advantages,
    overlong_penalty,
    token_logprobs,
)
from stages.post_training.rollout import RolloutGroup

EPS_LOW, EPS_HIGH, IS_CAP, TEMPERATURE = 0.2, 0.28, 2.0, 0.7
PROMPTS = ["Say 3.", "Say 7."]
LENGTHS = [[3, 5, 1, 4], [2, 6, 6, 3]]  # completion lengths per group


def _zero_reward(completions: list[Any], **_: Any) -> list[float | None]:
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def trl_trainer(tiny_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from stages.post_training.hf_io import load_model, load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_policy)
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        loss_type="dapo",
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        beta=0.0,
        temperature=TEMPERATURE,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        # trl defaults to bf16 autocast (on CPU too): its LM head would then run in bf16
        # and its log-probs differ from fp32 ones by ~1e-3. The oracle compares in fp32.
        bf16=False,
        report_to=[],
    )
    trainer = GRPOTrainer(
        model=load_model(tiny_policy),
        reward_funcs=_zero_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 2]),
        processing_class=tok,
    )
    # Set by trl's training_step; one optimizer step = one accumulation window here.
    trainer.current_gradient_accumulation_steps = 1
    assert trainer.model is not None
    trainer.model.train()
    return trainer


def _groups(tok: Any, seed: int) -> list[RolloutGroup]:
    from stages.post_training.rollout import prompt_ids

    gen = torch.Generator().manual_seed(seed)
    vocab = int(tok.vocab_size)
    groups = []
    for gi, (prompt, lengths) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        comps = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        rewards = torch.rand(len(lengths), generator=gen).round().tolist()
        rewards[0], rewards[1] = 1.0, 0.0  # never uniform
        groups.append(
            RolloutGroup(
                id=gi,
                version=0,
                worker=0,
                prompt_ids=prompt_ids(tok, prompt),
                completion_ids=comps,
                behav_logp=[[0.0] * n for n in lengths],  # filled in by the caller
                lengths=lengths,
                truncated=[False] * len(lengths),
                rewards=rewards,
                task_rewards=rewards,
                gen_s=0.0,
            )
        )
    return groups


def _trl_inputs(g: RolloutGroup, pad: int) -> dict[str, torch.Tensor]:
    width = max(g.lengths)
    comp = torch.full((len(g.lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(g.lengths), width, dtype=torch.long)
    for i, ids in enumerate(g.completion_ids):
        comp[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    prompt = torch.tensor([g.prompt_ids] * len(g.lengths), dtype=torch.long)
    return {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": comp,
        "completion_mask": mask,
    }


def _trl_logps(trainer: Any, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    """trl's own per-token log-probs (its fused LM head, its temperature)."""
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inp["prompt_ids"], inp["completion_ids"]], dim=1),
            torch.cat([inp["prompt_mask"], inp["completion_mask"]], dim=1),
            inp["completion_ids"].size(1),
        )
    return logps


def _trl_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """trl's group advantage (``_generate_and_score_completions``, scale_rewards="group")."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards, dim=1, keepdim=True)
    return (rewards - mean) / (nanstd(rewards, dim=1).unsqueeze(1) + 1e-4)


def _grads(model: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _assert_same(ours: tuple[float, dict[str, torch.Tensor]], trl: Any) -> None:
    loss_a, grads_a = ours
    loss_b, grads_b = trl
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for n in grads_a:
        assert torch.allclose(grads_a[n], grads_b[n], rtol=1e-4, atol=1e-7), n


def _rlvr_config(**cfg: Any) -> RLVRConfig:
    """The recipe a step's batch is assembled for (group size, reward scaling,
    truncation masking)."""
    provenance = {"source": "s", "license": "MIT"}
    ref = {"uri": "file:///x.jsonl", "sha256": "0" * 64, "provenance": provenance}
    return RLVRConfig.model_validate(
        {
            "data": ref,
            "steps": 1,
            "temperature": TEMPERATURE,
            "epsilon": EPS_LOW,
            "epsilon_high": EPS_HIGH,
            "is_truncation": IS_CAP,
            "max_completion_tokens": 8,
            "overlong_buffer_tokens": 2,
            **cfg,
        }
    )


def test_group_advantages_equal_trls() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.25, 1.0, 0.0]])
    assert torch.allclose(group_advantages(rewards), _trl_advantages(rewards), atol=1e-6)


def test_the_engine_objectives_loss_equals_trl_dapo_with_importance_correction(
    trl_trainer: Any,
) -> None:
    """The engine's grpo objective (``GRPOObjective.loss_sum`` over the batch the
    driver's controller assembles, divided by its denominator, one rank) against the
    same trl loss: the same completions padded into one batch, one forward."""
    from stages.post_training.grpo_objective import GRPOObjective, assemble
    from stages.post_training.step_groups import step_groups
    from stages.trainer.config import GRPOSettings

    trainer, tok = trl_trainer, trl_trainer.processing_class
    pad = int(tok.pad_token_id)
    groups = _groups(tok, seed=1)
    inputs = [_trl_inputs(g, pad) for g in groups]
    gen = torch.Generator().manual_seed(2)
    for g, inp in zip(groups, inputs, strict=True):
        cur = _trl_logps(trainer, inp)
        behav = cur + 1.0 * torch.randn(cur.shape, generator=gen)
        g.behav_logp = [behav[i, :n].tolist() for i, n in enumerate(g.lengths)]
    rewards = torch.tensor([g.rewards for g in groups])
    total = sum(sum(g.lengths) for g in groups)

    settings = GRPOSettings(
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        temperature=TEMPERATURE,
        is_truncation=IS_CAP,
    )
    objective = GRPOObjective(settings, Path("unused"), dp_rank=0, dp_world=1)
    batch = assemble(step_groups(0, list(groups), _rlvr_config(), pad))
    assert float(batch["mask"].sum()) == total
    logits = trainer.model(input_ids=batch["input_ids"]).logits
    loss = objective.loss_sum(logits, batch) / float(batch["mask"].sum())
    loss.backward()
    ours = (float(loss.detach()), _grads(trainer.model))
    theirs, capped = _trl_dapo_truncated_is(trainer, groups, inputs, rewards, total)
    assert capped > 0
    _assert_same(ours, (theirs, _grads(trainer.model)))


def _trl_dapo_truncated_is(
    trainer: Any,
    groups: list[RolloutGroup],
    inputs: list[dict[str, torch.Tensor]],
    rewards: torch.Tensor,
    total: int,
) -> tuple[float, int]:
    """trl's dapo loss with the token-level truncated importance correction,
    accumulated over one micro-batch per group (gradients left on the model); returns
    (loss, tokens whose weight hit the cap)."""
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        theirs = 0.0
        capped = 0
        for g, a, inp in zip(groups, _trl_advantages(rewards), inputs, strict=True):
            old = _trl_logps(trainer, inp)
            behav = torch.zeros_like(old)
            for i, lp in enumerate(g.behav_logp):
                behav[i, : len(lp)] = torch.tensor(lp)
            mask = inp["completion_mask"]
            # trl's ratio, as _generate_and_score_completions builds it (token_truncate).
            ratio = torch.exp((old - behav) * mask).clamp(max=IS_CAP)
            capped += int(((ratio == IS_CAP) & mask.bool()).sum())
            loss = trainer._compute_loss(
                trainer.model,
                {
                    **inp,
                    "advantages": a,
                    "old_per_token_logps": old,
                    "importance_sampling_ratio": ratio,
                    "num_items_in_batch": torch.tensor(total),
                },
            )
            loss.backward()
            theirs += float(loss.detach())
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    return theirs, capped


def _moved_policy_losses(
    trainer: Any, *, eps_low: float, eps_high: float, loss_type: str = "dapo"
) -> tuple[tuple[float, dict[str, torch.Tensor]], tuple[float, dict[str, torch.Tensor]], int]:
    """(ours, trl's, tokens past a clip bound) on one micro-batch whose old policy is
    the current one plus noise, so ratios land on both sides of both clip bounds."""
    tok = trainer.processing_class
    pad = int(tok.pad_token_id)
    g = _groups(tok, seed=3)[1]
    inp = _trl_inputs(g, pad)
    gen = torch.Generator().manual_seed(4)
    cur = _trl_logps(trainer, inp)
    old = cur + 0.4 * torch.randn(cur.shape, generator=gen)
    mask = inp["completion_mask"]
    adv = group_advantages(torch.tensor([g.rewards]))[0]
    total = int(mask.sum())

    seq = torch.cat([inp["prompt_ids"], inp["completion_ids"]], dim=1)
    p = inp["prompt_ids"].shape[1]
    logp = token_logprobs(
        trainer.model(input_ids=seq).logits[:, p - 1 : -1], inp["completion_ids"], TEMPERATURE
    )
    tok_loss = dapo_token_loss(
        logp, old, old, adv, eps_low=eps_low, eps_high=eps_high, is_truncation=None
    )
    loss = aggregate(tok_loss, mask, total)
    loss.backward()
    ours = (float(loss.detach()), _grads(trainer.model))

    ratio = torch.exp(cur - old)
    a = adv.unsqueeze(1)
    past = ((a > 0) & (ratio > 1 + EPS_HIGH)) | ((a < 0) & (ratio < 1 - EPS_LOW))
    clipped = int((past & mask.bool()).sum())

    trainer.loss_type = loss_type
    try:
        t_loss = trainer._compute_loss(
            trainer.model,
            {
                **inp,
                "advantages": _trl_advantages(torch.tensor([g.rewards]))[0],
                "old_per_token_logps": old,
                "num_items_in_batch": torch.tensor(total),
            },
        )
        t_loss.backward()
    finally:
        trainer.loss_type = "dapo"
    return ours, (float(t_loss.detach()), _grads(trainer.model)), clipped


def test_clip_higher_equals_trls_epsilon_and_epsilon_high(trl_trainer: Any) -> None:
    ours, theirs, clipped = _moved_policy_losses(trl_trainer, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    assert clipped > 0  # some tokens sit past a clip bound, so the bounds matter
    _assert_same(ours, theirs)


def test_swapped_clip_bounds_differ_from_trl(trl_trainer: Any) -> None:
    """The oracle can fail: clip bounds the wrong way round give another loss."""
    ours, theirs, _ = _moved_policy_losses(trl_trainer, eps_low=EPS_HIGH, eps_high=EPS_LOW)
    assert ours[0] != pytest.approx(theirs[0], rel=1e-5, abs=1e-7) or any(
        not torch.allclose(ours[1][n], theirs[1][n], rtol=1e-4, atol=1e-7) for n in ours[1]
    )


def test_bnpo_equals_ours_on_one_micro_batch_but_grpo_does_not(trl_trainer: Any) -> None:
    ours, bnpo, _ = _moved_policy_losses(
        trl_trainer, eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_type="bnpo"
    )
    _assert_same(ours, bnpo)
    # trl's "grpo" averages per sequence first: long completions weigh less than ours.
    ours, grpo, _ = _moved_policy_losses(
        trl_trainer, eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_type="grpo"
    )
    assert ours[0] != pytest.approx(grpo[0], rel=1e-4)


def test_k3_kl_term_equals_trls_beta(trl_trainer: Any) -> None:
    trainer, tok = trl_trainer, trl_trainer.processing_class
    pad = int(tok.pad_token_id)
    g = _groups(tok, seed=5)[0]
    inp = _trl_inputs(g, pad)
    cur = _trl_logps(trainer, inp)
    ref = cur + 0.3 * torch.randn(cur.shape, generator=torch.Generator().manual_seed(6))
    mask = inp["completion_mask"]
    total = int(mask.sum())
    adv = group_advantages(torch.tensor([g.rewards]))[0]
    seq = torch.cat([inp["prompt_ids"], inp["completion_ids"]], dim=1)
    p = inp["prompt_ids"].shape[1]
    logp = token_logprobs(
        trainer.model(input_ids=seq).logits[:, p - 1 : -1], inp["completion_ids"], TEMPERATURE
    )
    tok_loss = dapo_token_loss(
        logp,
        logp.detach(),
        logp.detach(),
        adv,
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        is_truncation=None,
        ref_logp=ref,
        beta=0.1,
    )
    loss = aggregate(tok_loss, mask, total)
    loss.backward()
    ours = (float(loss.detach()), _grads(trainer.model))
    # trl's default multiplies the KL by the (differentiable, value-1) ratio, which
    # changes its gradient (DeepSeek-V3.2's unbiased KL); ours is the plain k3 term.
    trainer.beta, trainer.args.use_bias_correction_kl = 0.1, False
    try:
        t_loss = trainer._compute_loss(
            trainer.model,
            {
                **inp,
                "advantages": _trl_advantages(torch.tensor([g.rewards]))[0],
                "ref_per_token_logps": ref,
                "num_items_in_batch": torch.tensor(total),
            },
        )
        t_loss.backward()
    finally:
        trainer.beta, trainer.args.use_bias_correction_kl = 0.0, True
    _assert_same(ours, (float(t_loss.detach()), _grads(trainer.model)))


# -- no trl equivalent: checked against the formula -------------------------------------


@pytest.mark.parametrize("length", [0, 10, 80, 81, 90, 99, 100, 101, 500])
@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_overlong_shaping_is_dapos_formula(length: int, factor: float) -> None:
    """No trl trainer setting: DAPO eq. 13 (L_max = 100, L_cache = 20) times factor."""
    l_max, l_cache = 100, 20
    if length <= l_max - l_cache:
        expected = 0.0
    elif length <= l_max:
        expected = ((l_max - l_cache) - length) / l_cache
    else:
        expected = -1.0
    got = overlong_penalty(length, max_tokens=l_max, buffer_tokens=l_cache, factor=factor)
    assert got == pytest.approx(factor * expected)


def test_dynamic_sampling_is_dapos_rule() -> None:
    """No trl equivalent (trl 1.16 logs frac_reward_zero_std only): DAPO keeps a group
    iff 0 < accuracy < 1, i.e. its rewards are not all equal, here up to a drop bound."""
    offered = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0.2, 0.3], [1.0, 1.0]]
    sampler = DynamicSampler(True, max_drops=2)
    kept = [sampler.offer(r) for r in offered]
    # Uniform groups 0 and 2 are dropped; the bound (2) is then reached, so 3 and 5 stay.
    assert kept == [False, True, False, True, True, True]
    sampler.reset()
    assert [sampler.offer(r) for r in offered[:3]] == [False, True, False]
    assert all(DynamicSampler(False, 8).offer(r) for r in offered)
