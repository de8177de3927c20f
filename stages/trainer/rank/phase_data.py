"""The data a curriculum run trains and evaluates on: a held-out split of the run's
own documents, the run's HF tokenizer, and token shards per data role."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stages.errors import ErrorCode, ItoError
from stages.model.tokenizer import ByteTokenizer
from stages.trainer.rank.data import TextEncoder, build_token_shards, iter_documents

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HELDOUT_NAME = "heldout.jsonl"


class HFEncoder:
    """``build_token_shards``' tokenizer interface over an HF tokenizer (ids + EOS)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tok = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_id = int(tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return [*self.tok(text, add_special_tokens=False)["input_ids"], self.eos_id]


@dataclass
class PhaseData:
    role_shards: dict[str, list[str]]
    heldout_texts: list[str]
    tokenizer_dir: Path


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % 1000


def split_heldout(
    files_by_role: dict[str, list[Path]], text_field: str, *, permille: int, min_docs: int
) -> tuple[dict[str, list[str]], list[str]]:
    """Deterministic split by content hash: a document is held out when its hash
    bucket is below ``permille`` (at least ``min_docs``, at most half, overall)."""
    docs: list[tuple[int, str, int, str]] = []
    for role, files in sorted(files_by_role.items()):
        for f in files:
            for text in iter_documents(Path(f), text_field):
                docs.append((_bucket(text), role, len(docs), text))
    if not docs:
        raise ItoError(ErrorCode.data_empty, "no documents to train on")
    held = {d[2] for d in docs if d[0] < permille}
    if len(held) < min_docs:
        ranked = sorted(docs, key=lambda d: (d[0], d[2]))
        held = {d[2] for d in ranked[: min(min_docs, len(docs) // 2)]}
    train: dict[str, list[str]] = {}
    heldout: list[str] = []
    for _, role, i, text in docs:
        if i in held:
            heldout.append(text)
        else:
            train.setdefault(role, []).append(text)
    return train, heldout


def prepare_phase_data(
    files_by_role: dict[str, list[Path]],
    workdir: Path,
    *,
    text_field: str,
    vocab_size: int,
    permille: int,
    min_docs: int,
    tokenizer_path: str | None = None,
    model_max_length: int = 2048,
) -> PhaseData:
    from stages.hf.bpe import BPEEncoder, save_bpe, train_bpe

    train, heldout = split_heldout(files_by_role, text_field, permille=permille, min_docs=min_docs)
    encoder: TextEncoder
    if tokenizer_path:
        # A tenant's own tokenizer folder may be any HF tokenizer: transformers reads it.
        from stages.hf.tokenizer import load_tokenizer, save_tokenizer

        tokenizer = load_tokenizer(tokenizer_path.removeprefix("file://"))
        if len(tokenizer) > vocab_size:
            raise ItoError(
                ErrorCode.tokenizer_invalid,
                f"tokenizer has {len(tokenizer)} ids, the model {vocab_size}",
            )
        tok_dir = save_tokenizer(tokenizer, workdir / "tokenizer")
        encoder = HFEncoder(tokenizer)
    else:
        # The run's own BPE: trained, saved and encoded without transformers or torch.
        texts = [t for role in sorted(train) for t in train[role]]
        bpe = train_bpe(texts, vocab_size=vocab_size)
        tok_dir = save_bpe(bpe, workdir / "tokenizer", model_max_length=model_max_length)
        # The byte vocabulary encodes exactly like ByteTokenizer (and much faster).
        encoder = BPEEncoder(bpe)
        if encoder.vocab_size == ByteTokenizer.vocab_size:
            encoder = ByteTokenizer()
    role_shards: dict[str, list[str]] = {}
    for role, texts in sorted(train.items()):
        src = workdir / "phase_data" / f"{role}.jsonl"
        src.parent.mkdir(parents=True, exist_ok=True)
        with src.open("w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        shards = build_token_shards(
            [src], workdir / "tokens" / role, tokenizer=encoder, text_field="text"
        )
        role_shards[role] = [str(s) for s in shards]
    with (workdir / "phase_data" / HELDOUT_NAME).open("w", encoding="utf-8") as f:
        for t in heldout:
            f.write(json.dumps({"text": t}) + "\n")
    return PhaseData(role_shards, heldout, tok_dir)
