"""A byte-level tokenizer: no vocabulary file, no download, lossless for any text."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Token ids 0..255 are bytes; 256.. are specials. ``vocab_size`` is 260."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    unk_id = 259  # reserved; bytes never need it
    vocab_size = 260

    def encode(self, text: str, *, bos: bool = False, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
