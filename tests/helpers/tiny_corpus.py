"""The engine tests' training text: 300 short documents of a few repeated words, so a
tiny model's loss falls within the few dozen steps a test trains."""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_corpus(path: Path, docs: int = 300) -> Path:
    """``path`` as a jsonl file of ``docs`` documents with a ``text`` field."""
    with path.open("w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": f"doc {i}: " + "the quick brown fox " * (i % 5 + 1)}))
            f.write("\n")
    return path
