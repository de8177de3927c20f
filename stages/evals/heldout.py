"""Held-out loss and bits per byte of a causal LM on texts (no lm-eval needed).

The held-out stream is cut into windows and the windows into batches; a
data-parallel rank scores the batches ``b % parts == part`` and returns each batch's
nats, its predicted tokens and their UTF-8 bytes. The reduced sums give exactly the
score one rank gives for the same weights (``heldout_scores`` is that case): every
batch is the same tensor whichever rank scores it, and nats are added with
``math.fsum``, whose result does not depend on the order."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the sums are reduced in the driver, which never imports torch
    import torch
    from transformers import PreTrainedTokenizerBase


class HeldoutSums(BaseModel):
    """What one rank's share of the held-out batches adds up to."""

    model_config = ConfigDict(extra="forbid")
    batch_nats: dict[int, float] = Field(default_factory=dict)
    tokens: int = Field(default=0, ge=0)
    bytes: float = Field(default=0.0, ge=0)

    def __add__(self, other: HeldoutSums) -> HeldoutSums:
        if self.batch_nats.keys() & other.batch_nats.keys():
            raise ValueError("two ranks scored the same held-out batch")
        return HeldoutSums(
            batch_nats={**self.batch_nats, **other.batch_nats},
            tokens=self.tokens + other.tokens,
            bytes=self.bytes + other.bytes,
        )

    def scores(self) -> dict[str, float]:
        if self.tokens == 0:
            raise ValueError("no held-out window was scored")
        nats = math.fsum(self.batch_nats.values())
        return {
            "loss": nats / self.tokens,
            "bits_per_byte": nats / math.log(2) / max(self.bytes, 1.0),
        }


def reduce_sums(parts: Iterable[HeldoutSums]) -> HeldoutSums:
    total = HeldoutSums()
    for p in parts:
        total = total + p
    return total


# Per process, by tokenizer folder and size: a rank scores several held-out shares
# each phase end, and decoding a 128k vocabulary a token at a time takes seconds.
_TOKEN_BYTES: dict[tuple[str, int], torch.Tensor] = {}


def _token_bytes(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """UTF-8 bytes each token id stands for (0 for specials)."""
    import torch

    n = len(tokenizer)
    key = (str(getattr(tokenizer, "name_or_path", "") or ""), n)
    if key[0] and key in _TOKEN_BYTES:
        return _TOKEN_BYTES[key]
    specials = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(n)])
    out = torch.tensor(
        [0 if i in specials else len(t.encode("utf-8")) for i, t in enumerate(texts)],
        dtype=torch.float64,
    )
    if key[0]:
        _TOKEN_BYTES[key] = out
    return out


# The split a rank cut last, by tokenizer, texts and window size: a rank scores
# several shares of one phase end's windows.
_LAST_WINDOWS: list[tuple[tuple[str, int, int, int, tuple[str, ...]], torch.Tensor]] = []


def heldout_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, seq_len: int, max_tokens: int
) -> torch.Tensor:
    """Each text encoded as the trainer encodes documents (ids then EOS), the stream
    cut into ``seq_len`` windows, at most ``max_tokens`` tokens in all."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    key = (name, len(tokenizer), seq_len, max_tokens, tuple(texts))
    if name and _LAST_WINDOWS and _LAST_WINDOWS[0][0] == key:
        return _LAST_WINDOWS[0][1]
    windows = _cut_windows(tokenizer, texts, seq_len=seq_len, max_tokens=max_tokens)
    if name:
        _LAST_WINDOWS[:] = [(key, windows)]
    return windows


def _cut_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, seq_len: int, max_tokens: int
) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= max_tokens:
            break
    import torch

    ids = ids[:max_tokens]
    n_win = len(ids) // seq_len
    if n_win == 0:
        raise ValueError(f"held-out split too small: {len(ids)} tokens < seq_len {seq_len}")
    return torch.tensor(ids[: n_win * seq_len], dtype=torch.long).view(n_win, seq_len)


def heldout_sums(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    seq_len: int,
    max_tokens: int = 16384,
    batch_size: int = 8,
    part: int = 0,
    parts: int = 1,
) -> HeldoutSums:
    """Next-token nats of each of this rank's batches (every ``parts``-th from
    ``part``), with their token and byte counts."""
    import torch
    import torch.nn.functional as F

    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}")
    stream = heldout_windows(tokenizer, texts, seq_len=seq_len, max_tokens=max_tokens)
    tb = _token_bytes(tokenizer)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batch_nats: dict[int, float] = {}
    tokens, nbytes = 0, 0.0
    try:
        with torch.no_grad():
            for b in range(part, math.ceil(len(stream) / batch_size), parts):
                x = stream[b * batch_size : (b + 1) * batch_size].to(device)
                logits = model(input_ids=x).logits[:, :-1].float()
                target = x[:, 1:]
                ce = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none"
                )
                batch_nats[b] = float(ce.double().sum())
                tokens += target.numel()
                nbytes += float(tb[target.reshape(-1).cpu()].sum())
    finally:
        model.train(was_training)
    return HeldoutSums(batch_nats=batch_nats, tokens=tokens, bytes=nbytes)


def heldout_scores(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    seq_len: int,
    max_tokens: int = 16384,
    batch_size: int = 8,
) -> dict[str, float]:
    """Mean next-token loss (nats) and bits per byte over ``texts`` (one rank scores
    every window). Bits per byte = summed nats / ln 2 / UTF-8 bytes of the predicted
    tokens, which compares models with different tokenizers."""
    return heldout_sums(
        model, tokenizer, texts, seq_len=seq_len, max_tokens=max_tokens, batch_size=batch_size
    ).scores()
