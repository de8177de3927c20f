"""Held-out loss and bits per byte of a causal LM on texts (no lm-eval needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def _token_bytes(tokenizer: Any) -> torch.Tensor:
    """UTF-8 bytes each token id stands for (0 for specials)."""
    specials = set(tokenizer.all_special_ids)
    n = len(tokenizer)
    out = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        if i not in specials:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


@torch.no_grad()
def heldout_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    seq_len: int,
    max_tokens: int = 16384,
    batch_size: int = 8,
) -> dict[str, float]:
    """Mean next-token loss (nats) and bits per byte over ``texts``.

    Each text is encoded as the trainer encodes documents (ids then EOS) and the
    stream is cut into ``seq_len`` windows, at most ``max_tokens`` tokens in all.
    Bits per byte = summed nats / ln 2 / UTF-8 bytes of the predicted tokens, which
    compares models with different tokenizers.
    """
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    n_win = len(ids) // seq_len
    if n_win == 0:
        raise ValueError(f"held-out split too small: {len(ids)} tokens < seq_len {seq_len}")
    stream = torch.tensor(ids[: n_win * seq_len], dtype=torch.long).view(n_win, seq_len)
    tb = _token_bytes(tokenizer)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nats, tokens, nbytes = 0.0, 0, 0.0
    try:
        for i in range(0, n_win, batch_size):
            x = stream[i : i + batch_size].to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            target = x[:, 1:]
            ce = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum"
            )
            nats += float(ce)
            tokens += target.numel()
            nbytes += float(tb[target.reshape(-1).cpu()].sum())
    finally:
        model.train(was_training)
    return {"loss": nats / tokens, "bits_per_byte": nats / math.log(2) / max(nbytes, 1.0)}
