"""Deterministic, resumable data pipeline over tokenized shards.

``build_token_shards`` turns jsonl / parquet / plain-text files into ``.npy`` token
shards plus an ``index.json`` (digests and token counts). The same inputs always
give the same bytes, so a shard set is identified by its index digest.

``TokenLoader`` cuts the concatenated token stream into fixed-length windows and
serves them in a seeded, per-epoch shuffled order; each data-parallel rank reads a
disjoint strided slice. Its position (epoch, batch within the epoch) is the whole
state: after ``load_state_dict`` the next batch is exactly the one an uninterrupted
loader would have produced. The position is rank-independent (all ranks step in
lockstep), so a healed replica group may load a live peer's loader state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import numpy as np

from stages.atomic_write import open_atomic, write_text
from stages.errors import ErrorCode, ItoError
from stages.model.tokenizer import ByteTokenizer

if TYPE_CHECKING:  # the driver builds shards here and never imports torch
    import torch

INDEX_NAME = "index.json"
INDEX_VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 24  # 16M tokens: 32 MB of uint16 per shard
_READ_CHUNK = 1 << 20
_TEXT_SUFFIXES = (".txt", ".text", ".md")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def iter_documents(path: Path, text_field: str) -> Iterator[str]:
    """Yield the documents of one input file, in file order."""
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ItoError(
                        ErrorCode.data_format_unsupported,
                        f"{path.name}:{lineno}: not valid JSON ({e.msg})",
                    ) from e
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ItoError(
                        ErrorCode.data_format_unsupported,
                        f"{path.name}:{lineno}: no string field {text_field!r}",
                    )
                yield text
    elif suffix in _PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ItoError(
                ErrorCode.data_format_unsupported, f"{path.name}: no column {text_field!r}"
            )
        for batch in pf.iter_batches(columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield str(text)
    elif suffix in _TEXT_SUFFIXES:
        # One document per file: plain text has no reliable record separator.
        yield path.read_text(encoding="utf-8")
    else:
        raise ItoError(
            ErrorCode.data_format_unsupported,
            f"{path.name}: unsupported input format {suffix!r} (jsonl, parquet or txt)",
        )


def _write_shard(path: Path, tokens: np.ndarray) -> str:
    with open_atomic(path) as f:
        np.save(f, tokens, allow_pickle=False)
    return _sha256_file(path)


class TextEncoder(Protocol):
    """What token shards are built with: ids of a text with its EOS (``ByteTokenizer``,
    the run's BPE, an HF tokenizer behind ``phase_data.HFEncoder``)."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


def _encode(tokenizer: TextEncoder, text: str, dtype: type[np.integer]) -> np.ndarray:
    if type(tokenizer) is ByteTokenizer:
        # Same ids as ByteTokenizer.encode(text) (bytes, then EOS) without a Python list.
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        ids = np.empty(len(raw) + 1, dtype=dtype)
        ids[:-1] = raw
        ids[-1] = tokenizer.eos_id
        return ids
    return np.asarray(tokenizer.encode(text), dtype=dtype)


class TokenShard(TypedDict):
    """One shard as ``index.json`` lists it: its file (in the index's folder), its
    tokens and its sha256."""

    file: str
    tokens: int
    sha256: str


def build_token_shards(
    inputs: list[Path],
    out_dir: Path,
    *,
    tokenizer: TextEncoder,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> list[Path]:
    """Tokenize ``inputs`` (in the given order) into ``out_dir/shard_NNNNN.npy``.

    Every document ends with EOS. Shards hold exactly ``shard_tokens`` tokens except
    the last. Writes ``out_dir/index.json`` last; returns the shard paths in order.
    """
    if shard_tokens <= 0:
        raise ValueError("shard_tokens must be positive")
    if not inputs:
        raise ItoError(ErrorCode.data_empty, "no input files")
    for p in inputs:
        if not Path(p).is_file():
            raise ItoError(ErrorCode.data_not_found, f"input not found: {Path(p).name}")
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("shard_*.npy"):
        stale.unlink()

    shards: list[TokenShard] = []
    paths: list[Path] = []
    buf = np.empty(shard_tokens, dtype=dtype)
    fill = 0

    def flush(n: int) -> None:
        path = out_dir / f"shard_{len(paths):05d}.npy"
        digest = _write_shard(path, buf[:n].copy())
        shards.append({"file": path.name, "tokens": n, "sha256": digest})
        paths.append(path)

    documents = 0
    for src in inputs:
        for text in iter_documents(Path(src), text_field):
            ids = _encode(tokenizer, text, dtype)
            documents += 1
            pos = 0
            while pos < len(ids):
                take = min(shard_tokens - fill, len(ids) - pos)
                buf[fill : fill + take] = ids[pos : pos + take]
                fill += take
                pos += take
                if fill == shard_tokens:
                    flush(fill)
                    fill = 0
    if fill:
        flush(fill)
    if not paths:
        raise ItoError(ErrorCode.data_empty, "inputs contain no documents")

    index = {
        "version": INDEX_VERSION,
        "dtype": np.dtype(dtype).name,
        "vocab_size": tokenizer.vocab_size,
        "shard_tokens": shard_tokens,
        "documents": documents,
        "total_tokens": sum(s["tokens"] for s in shards),
        # Names and digests only: absolute paths would make the bytes machine-specific.
        "inputs": [{"name": Path(p).name, "sha256": _sha256_file(Path(p))} for p in inputs],
        "shards": shards,
    }
    write_text(out_dir / INDEX_NAME, json.dumps(index, indent=1, sort_keys=True) + "\n")
    return paths


def read_token_index(out_dir: Path, *, verify: bool = False) -> list[Path]:
    """The shard paths listed by ``out_dir/index.json``; ``verify`` re-hashes them."""
    index_path = out_dir / INDEX_NAME
    if not index_path.is_file():
        raise ItoError(ErrorCode.data_not_found, f"no {INDEX_NAME} in {out_dir}")
    index = json.loads(index_path.read_text())
    paths = []
    for s in index["shards"]:
        p = out_dir / s["file"]
        if not p.is_file():
            raise ItoError(ErrorCode.data_not_found, f"shard missing: {s['file']}")
        if verify and _sha256_file(p) != s["sha256"]:
            raise ItoError(ErrorCode.data_digest_mismatch, f"shard digest mismatch: {s['file']}")
        paths.append(p)
    return paths


class TokenLoader:
    """Seeded shuffled fixed-length windows over token shards, exactly resumable.

    Window ``w`` is tokens ``[w*seq_len, (w+1)*seq_len)`` of the concatenated shards
    (windows may span a shard boundary; the tail shorter than ``seq_len`` is unused).
    Epoch ``e`` orders windows by a permutation seeded with ``(seed, e)``; rank ``r``
    takes every ``dp_world``-th entry starting at ``r`` (equal counts on every rank),
    grouped into batches of ``micro_batch`` windows; a partial last batch is dropped.
    """

    def __init__(
        self,
        shards: Sequence[Path],
        *,
        seq_len: int,
        micro_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_world: int = 1,
    ):
        if seq_len <= 0 or micro_batch <= 0:
            raise ValueError("seq_len and micro_batch must be positive")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_world})")
        if not shards:
            raise ItoError(ErrorCode.data_empty, "no token shards")
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self._arrays = [np.load(Path(p), mmap_mode="r", allow_pickle=False) for p in shards]
        sizes = np.array([len(a) for a in self._arrays], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])
        self.total_tokens = int(self._starts[-1])
        self.num_windows = self.total_tokens // seq_len
        self.batches_per_epoch = (self.num_windows // dp_world) // micro_batch
        if self.batches_per_epoch == 0:
            raise ItoError(
                ErrorCode.data_empty,
                f"{self.total_tokens} tokens give {self.num_windows} windows of {seq_len}: "
                f"fewer than one batch of {micro_batch} per rank for {dp_world} ranks",
            )
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    # --- position -----------------------------------------------------------------
    @property
    def batches_served(self) -> int:
        """Batches this rank has produced since the start of training."""
        return self.epoch * self.batches_per_epoch + self.batch_in_epoch

    @property
    def tokens_per_batch(self) -> int:
        return self.micro_batch * self.seq_len

    def skip(self, num_batches: int) -> None:
        """Move past ``num_batches`` batches without reading them (a skipped data window)."""
        if num_batches < 0:
            raise ValueError("num_batches must be >= 0")
        self._seek(self.batches_served + num_batches)

    def _seek(self, batches_served: int) -> None:
        self.epoch, self.batch_in_epoch = divmod(batches_served, self.batches_per_epoch)

    # --- reading ------------------------------------------------------------------
    def _rank_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            per_rank = self.num_windows // self.dp_world
            self._order = perm[self.dp_rank :: self.dp_world][:per_rank]
            self._order_epoch = epoch
        return self._order

    def _window(self, w: int) -> np.ndarray:
        lo = w * self.seq_len
        hi = lo + self.seq_len
        i = int(np.searchsorted(self._starts, lo, side="right")) - 1
        parts = []
        while lo < hi:
            start = int(self._starts[i])
            end = min(hi, int(self._starts[i + 1]))
            parts.append(self._arrays[i][lo - start : end - start])
            lo = end
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def next_batch(self) -> torch.Tensor:
        """The next ``LongTensor[micro_batch, seq_len]``; epochs wrap deterministically."""
        order = self._rank_order(self.epoch)
        b = self.batch_in_epoch * self.micro_batch
        windows = order[b : b + self.micro_batch]
        batch = np.stack([self._window(int(w)) for w in windows]).astype(np.int64)
        self._seek(self.batches_served + 1)
        import torch

        return torch.from_numpy(batch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    # --- checkpointing --------------------------------------------------------------
    def _identity(self) -> dict[str, int]:
        return {
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "seed": self.seed,
            "dp_world": self.dp_world,
            "num_windows": self.num_windows,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "dp_rank": self.dp_rank,
            **self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The data identity must match (dp_rank need not:
        positions are shared by all ranks)."""
        mismatched = {
            k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v
        }
        if mismatched:
            raise ItoError(
                ErrorCode.checkpoint_corrupt,
                f"data loader state does not match this loader: {mismatched}",
            )
        self._seek(int(state["epoch"]) * self.batches_per_epoch + int(state["batch_in_epoch"]))
