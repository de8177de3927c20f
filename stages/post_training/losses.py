"""GRPO with the DAPO fixes, as pure tensor functions.

- group advantages: reward minus the group mean (optionally over the group std);
- clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high], eps_high > eps_low;
- token-level aggregation: the loss is a sum over every completion token of the
  batch divided by the batch's token count, so micro-batches sum to the full batch;
- overlong shaping: trl's soft overlong punishment scaled by a factor;
- decoupled importance sampling (AReaL): the PPO ratio is taken against the
  trainer's proximal policy, and each token is weighted by prox/behaviour, truncated,
  so a sample generated under an older policy version is corrected, not trusted;
- no KL term unless beta > 0 (k3 estimator against a frozen reference).
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """rewards [groups, group_size] -> advantages of the same shape, zero mean per group."""
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True) + eps)


def overlong_penalty(length: int, *, max_tokens: int, buffer_tokens: int, factor: float) -> float:
    """DAPO's soft overlong punishment (trl's ``get_soft_overlong_punishment``) times
    ``factor``: 0 up to max - buffer, linear to -factor at max, -factor beyond."""
    from trl.rewards.other_rewards import get_soft_overlong_punishment

    if buffer_tokens == 0:
        return -factor if length >= max_tokens else 0.0
    fn = get_soft_overlong_punishment(
        max_completion_len=max_tokens, soft_punish_cache=buffer_tokens
    )
    return float(factor * fn(completion_ids=[[0] * length])[0])


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) per position; logits [B, T, V], targets [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def dapo_token_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    is_truncation: float | None = 2.0,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Per-token loss [B, T]; ``advantages`` is [B] (one per completion).

    ``prox_logp`` and ``behav_logp`` are constants (no gradient flows through them)."""
    prox = prox_logp.detach()
    ratio = torch.exp(logp - prox)
    adv = advantages.detach().unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if is_truncation is not None:
        weight = torch.exp(prox - behav_logp.detach()).clamp(max=is_truncation)
        loss = loss * weight
    if beta > 0 and ref_logp is not None:
        d = ref_logp.detach() - logp
        loss = loss + beta * (torch.exp(d) - d - 1.0)
    return loss


def aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, total_tokens: int | float
) -> torch.Tensor:
    """Token-level aggregation: sum over unmasked tokens / tokens of the whole batch."""
    kept = torch.where(mask.bool(), token_loss, torch.zeros_like(token_loss))
    return kept.sum() / max(float(total_tokens), 1.0)
