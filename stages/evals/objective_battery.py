"""The small batteries of the SFT and DPO objectives (the objectives themselves train
on the engine: ``stages.post_training.on_engine``; these run on its evaluating rank,
``stages.evals.objective_eval``).

Batteries (before and after, on the objective's own data; the curriculum's eval
batteries replace them where a run names one):
- SFT: mean next-token NLL of the conversations -> ``nll_before``, ``nll_after``,
  ``nll_gain`` = before - after;
- DPO: mean log-prob margin log p(chosen) - log p(rejected) -> ``margin_before``,
  ``margin_after``, ``margin_gain``, ``preference_accuracy``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _seq_logp(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict[str, str]],
    completion: list[dict[str, str]],
) -> float:
    """Sum of log p(completion tokens | prompt) under the chat template."""
    import torch

    p = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=False)
    ids = torch.tensor([list(full)], device=next(model.parameters()).device)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    tgt = ids[0, 1:]
    lp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return float(lp[len(p) - 1 :].sum())


def _as_messages(x: str | list[dict[str, str]], role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": x}] if isinstance(x, str) else list(x)


def sft_nll(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]]
) -> float:
    """Mean per-token NLL of the assistant turns."""
    model.eval()
    total, n = 0.0, 0
    for r in rows:
        msgs = r["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            comp = [m]
            k = len(
                tokenizer.apply_chat_template(msgs[:i] + comp, tokenize=True, return_dict=False)
            ) - len(
                tokenizer.apply_chat_template(
                    msgs[:i], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            total -= _seq_logp(model, tokenizer, msgs[:i], comp)
            n += max(k, 1)
    return total / max(n, 1)


def dpo_margins(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]]
) -> tuple[float, float]:
    """(mean margin, fraction with a positive margin)."""
    model.eval()
    margins = []
    for r in rows:
        prompt = _as_messages(r["prompt"], "user")
        c = _seq_logp(model, tokenizer, prompt, _as_messages(r["chosen"], "assistant"))
        j = _seq_logp(model, tokenizer, prompt, _as_messages(r["rejected"], "assistant"))
        margins.append(c - j)
    return sum(margins) / len(margins), sum(m > 0 for m in margins) / len(margins)


def objective_battery(
    kind: str,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
) -> dict[str, float]:
    """The objective's battery on ``model``: {"nll"} for sft, {"margin", "accuracy"} for dpo."""
    if kind == "sft":
        return {"nll": sft_nll(model, tokenizer, rows)}
    margin, accuracy = dpo_margins(model, tokenizer, rows)
    return {"margin": margin, "accuracy": accuracy}


def objective_gate_metrics(
    kind: str, before: dict[str, float], after: dict[str, float]
) -> dict[str, float]:
    """The gate's metrics of an objective from its battery before and after training."""
    if kind == "sft":
        return {
            "nll_before": before["nll"],
            "nll_after": after["nll"],
            "nll_gain": before["nll"] - after["nll"],
        }
    return {
        "margin_before": before["margin"],
        "margin_after": after["margin"],
        "margin_gain": after["margin"] - before["margin"],
        "preference_accuracy": after["accuracy"],
    }
