"""Config of the data-prep stage (the manifest's ``data`` section)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from stages.base import StrictModel
from stages.data_prep.stream.config import StreamConfig
from stages.pathfields import PathField


class DataProvenance(StrictModel):
    source: str = Field(min_length=1, max_length=512)
    license: str = Field(min_length=1, max_length=128)
    # Eval suites the tenant says this data was already decontaminated against.
    decontaminated_against: list[str] = Field(default_factory=list, max_length=64)


class DataRef(StrictModel):
    # file:///abs/path (a file or a folder of jsonl/parquet/txt); hf:// etc. are
    # recognised and refused unless cached locally.
    uri: Annotated[str, PathField("data", "any", form="file_uri", remote=True)] = Field(
        min_length=1, max_length=2048
    )
    # sha256 of the file's bytes; for a folder, sha256 of the sorted lines
    # "<relative path>\t<file sha256>\n" of every data file under it.
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: Literal["baseline", "custom"] = "custom"
    format: Literal["jsonl", "parquet", "text"] | None = None  # None: from the suffix
    text_field: str = "text"
    provenance: DataProvenance


class DedupConfig(StrictModel):
    enabled: bool = True
    threshold: float = Field(default=0.8, gt=0, lt=1)
    num_perm: int = Field(default=128, ge=16, le=1024)
    shingle_size: int = Field(default=5, ge=1, le=32, description="word shingles")
    seed: int = Field(default=1, ge=0, le=2**32 - 1, description="MinHash permutation seed")
    # LSH bands x rows: the fewest candidates whose S-curve still catches a pair at
    # the threshold with this probability (see stages/data_prep/minhash.py).
    recall_target: float = Field(default=0.99, gt=0, lt=1)
    # Sketching is sharded over Ray workers when Ray is up and the input has at least
    # this many documents, in shards of ``shard_docs``.
    ray_min_docs: int = Field(default=200_000, ge=1, le=10**12)
    shard_docs: int = Field(default=50_000, ge=1, le=10**8)
    shard_timeout_s: float = Field(default=1800.0, gt=0, le=86_400)


class DecontaminationConfig(StrictModel):
    enabled: bool = True
    ngram: int = Field(default=13, ge=4, le=64)
    mode: Literal["ngram", "overlap"] = "ngram"
    overlap_ngram: int = Field(default=8, ge=2, le=64)
    overlap_threshold: float = Field(default=0.5, gt=0, le=1)
    action: Literal["remove", "flag"] = "remove"


class LadderProbeConfig(StrictModel):
    enabled: bool = True
    seeds: int = Field(default=2, ge=2, le=8)
    # Proxy rung; on GPUs llama-150m, on the CPU testbed a tiny rung.
    rung_preset: str = "llama-probe-xs"
    tokens_per_param: float = Field(default=20.0, gt=0, le=10_000)
    reject_fails_gate: bool = False
    # Tokens each proxy run trains on; None: tokens_per_param x the rung's parameters.
    # The same for both arms, so the comparison stays at equal tokens per parameter.
    token_budget: int | None = Field(default=None, ge=1, le=10**12)
    seq_len: int = Field(default=128, ge=8, le=4096)
    batch_size: int = Field(default=8, ge=1, le=1024)
    lr: float = Field(default=3e-3, gt=0, le=10)
    # Held-out eval text (the eval suites' items) scored in bits per byte, capped.
    eval_bytes: int = Field(default=65_536, ge=256, le=1 << 30)
    # Decision: |mean difference| must exceed the t-quantile at this confidence times
    # the standard error from the pooled seed spread, and at least min_effect_bpb.
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    min_effect_bpb: float = Field(default=0.005, ge=0, le=100)
    device: Literal["auto", "cpu", "cuda"] = "auto"


class DataPrepConfig(StrictModel):
    refs: list[DataRef] = Field(min_length=1, max_length=256)
    eval_suites: list[str] = Field(default_factory=lambda: ["gsm8k"], max_length=64)
    eval_files: Annotated[list[str], PathField("data", "file", form="file_uri")] = Field(
        default_factory=list, max_length=256, description="file:/// eval files"
    )
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    decontamination: DecontaminationConfig = Field(default_factory=DecontaminationConfig)
    ladder_probe: LadderProbeConfig = Field(default_factory=LadderProbeConfig)
    # Field holding the text of an item in the jsonl ``eval_files``.
    eval_field: str = "question"
    # Local copies of remote refs: <cache_dir>/<scheme>/<host and path>. None:
    # ITO_DATA_CACHE or ~/.cache/ito/data.
    cache_dir: Annotated[str | None, PathField("data", "dir", form="path")] = None
    # The streaming engine: block size, output format, Ray Data, spilling, timeouts.
    stream: StreamConfig = Field(default_factory=StreamConfig)
    # The ladder probe reads at most this many bytes of cleaned text per role.
    probe_max_bytes: int = Field(default=256 * 2**20, ge=1, le=1 << 40)
