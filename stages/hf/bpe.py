"""The run's byte-level BPE with ``tokenizers`` alone: trained, saved as a folder that
``AutoTokenizer.from_pretrained`` loads (``stages.hf.tokenizer`` wraps the same
object for the ranks), and encoded into token ids. The driver tokenizes the run's
data with this module, so it never imports transformers or torch.

Ids are laid out like ``stages.model.tokenizer.ByteTokenizer``: byte ``b`` is id
``b`` (0..255), the specials are 256 pad, 257 bos, 258 eos, 259 unk, and learned
merges take 260.. in merge order. So with ``vocab_size == 260`` (the tiny presets)
the BPE has no merges and encodes exactly like the byte tokenizer the trainer's
token shards were built with; a larger vocabulary adds merges on top.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stages.atomic_write import write_text
from stages.errors import ErrorCode, ItoError

BYTE_VOCAB = 256
SPECIAL_TOKENS: dict[str, str] = {
    "pad_token": "<|pad|>",
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
    "unk_token": "<|unk|>",
}
BASE_VOCAB = BYTE_VOCAB + len(SPECIAL_TOKENS)  # 260
# Turns are delimited by bos ... eos, each starting with its role on its own line. An
# assistant turn's content and closing eos sit inside ``{% generation %}`` markers (they
# render nothing): ``return_assistant_tokens_mask`` then marks exactly what SFT trains,
# the stop token included, and trl's ``assistant_only_loss`` uses the template as it is.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|bos|>assistant\n' }}{% generation %}{{ message['content'] + '<|eos|>' }}"
    "{% endgeneration %}"
    "{% else %}"
    "{{ '<|bos|>' + message['role'] + '\n' + message['content'] + '<|eos|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}"
)
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _assemble(merges: list[tuple[str, str]]) -> Tokenizer:
    """A ByteLevel BPE with the fixed id layout above and the given merges."""
    vocab: dict[str, int] = {ch: b for b, ch in bytes_to_unicode().items()}
    for i, special in enumerate(SPECIAL_TOKENS.values()):
        vocab[special] = BYTE_VOCAB + i
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return tok


def train_bpe(texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` to ``vocab_size`` ids (at least 260).

    Deterministic for the same texts and settings. ``vocab_size == 260`` trains
    nothing: the result is the pure byte tokenizer.
    """
    if vocab_size < BASE_VOCAB:
        raise ItoError(
            ErrorCode.tokenizer_invalid,
            f"vocab_size {vocab_size} < {BASE_VOCAB} (256 bytes + 4 specials)",
        )
    merges: list[tuple[str, str]] = []
    if vocab_size > BASE_VOCAB:
        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=list(SPECIAL_TOKENS.values()),
        )
        raw.train_from_iterator(texts, trainer=trainer)
        spec = json.loads(raw.to_str())
        for m in spec["model"]["merges"]:
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            merges.append((a, b))
        merges = merges[: vocab_size - BASE_VOCAB]
    return _assemble(merges)


def save_bpe(tok: Tokenizer, out_dir: str | Path, *, model_max_length: int) -> Path:
    """``tokenizer.json`` (the tokenizers library's own format) and the HF config
    naming the specials, the chat template and the length: what
    ``AutoTokenizer.from_pretrained`` needs to build the fast tokenizer that
    ``stages.hf.tokenizer`` wraps (a test compares the two)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        **SPECIAL_TOKENS,
    }
    for name, text in ((TOKENIZER_FILE, tok.to_str()), (CONFIG_FILE, json.dumps(config, indent=2))):
        write_text(out / name, text)
    return out


class BPEEncoder:
    """``build_token_shards``' tokenizer interface (ids, then EOS) over a BPE."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eos = tok.token_to_id(SPECIAL_TOKENS["eos_token"])
        if eos is None:
            raise ItoError(ErrorCode.tokenizer_invalid, "the tokenizer has no eos token")
        self.eos_id = int(eos)

    def encode(self, text: str) -> list[int]:
        return [*self.tok.encode(text, add_special_tokens=False).ids, self.eos_id]
