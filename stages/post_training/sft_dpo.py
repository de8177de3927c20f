"""SFT and DPO with trl's ``SFTTrainer`` and ``DPOTrainer``, plus their small batteries.

Batteries (before and after, on the step's own data; the curriculum's eval
batteries replace them where a run names one):
- SFT: mean next-token NLL of the conversations -> ``nll_before``, ``nll_after``,
  ``nll_gain`` = before - after;
- DPO: mean log-prob margin log p(chosen) - log p(rejected) -> ``margin_before``,
  ``margin_after``, ``margin_gain``, ``preference_accuracy``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stages.post_training.config import DPOConfig, SFTConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _common_args(out: Path, steps: int, lr: float, batch: int) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "max_steps": steps,
        "learning_rate": lr,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
    }


def _seq_logp(
    model: Any, tokenizer: Any, prompt: list[dict[str, str]], completion: list[dict[str, str]]
) -> float:
    """Sum of log p(completion tokens | prompt) under the chat template."""
    import torch

    p = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=False)
    ids = torch.tensor([list(full)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    tgt = ids[0, 1:]
    lp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return float(lp[len(p) - 1 :].sum())


def _as_messages(x: Any, role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": x}] if isinstance(x, str) else list(x)


def sft_nll(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> float:
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


def dpo_margins(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean margin, fraction with a positive margin)."""
    model.eval()
    margins = []
    for r in rows:
        prompt = _as_messages(r["prompt"], "user")
        c = _seq_logp(model, tokenizer, prompt, _as_messages(r["chosen"], "assistant"))
        j = _seq_logp(model, tokenizer, prompt, _as_messages(r["rejected"], "assistant"))
        margins.append(c - j)
    return sum(margins) / len(margins), sum(m > 0 for m in margins) / len(margins)


def run_sft(
    cfg: SFTConfig, model: Any, tokenizer: Any, rows: list[dict[str, Any]], out: Path
) -> dict[str, float]:
    from datasets import Dataset
    from trl import SFTConfig as TrlSFTConfig
    from trl import SFTTrainer

    before = sft_nll(model, tokenizer, rows)
    args = TrlSFTConfig(
        **_common_args(out, cfg.steps, cfg.learning_rate, cfg.batch_size), max_length=cfg.max_length
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    result = trainer.train()
    after = sft_nll(model, tokenizer, rows)
    return {
        "nll_before": before,
        "nll_after": after,
        "nll_gain": before - after,
        "train_loss": float(result.training_loss),
        "steps": float(cfg.steps),
    }


def run_dpo(
    cfg: DPOConfig, model: Any, tokenizer: Any, rows: list[dict[str, Any]], out: Path
) -> dict[str, float]:
    from datasets import Dataset
    from trl import DPOConfig as TrlDPOConfig
    from trl import DPOTrainer

    m0, _ = dpo_margins(model, tokenizer, rows)
    args = TrlDPOConfig(
        **_common_args(out, cfg.steps, cfg.learning_rate, cfg.batch_size),
        beta=cfg.beta,
        max_length=cfg.max_length,
    )
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    result = trainer.train()
    m1, acc = dpo_margins(model, tokenizer, rows)
    return {
        "margin_before": m0,
        "margin_after": m1,
        "margin_gain": m1 - m0,
        "preference_accuracy": acc,
        "train_loss": float(result.training_loss),
        "steps": float(cfg.steps),
    }
