"""Rebuild train.jsonl: docstrings of the CPython 3.11 standard library, one paragraph a line.

Generic English technical prose that is not about grade-school math: the baseline
corpus of the ladder probe's tests and of the demo. Deterministic for a given CPython
version: ``python data/python_docs/build.py`` (writes beside this file).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path

SKIP = (
    "test",
    "idlelib",
    "tkinter",
    "turtle",
    "antigravity",
    "this",
    "__main__",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "venv",
    "msilib",
    "winreg",
    "winsound",
    "_",
)
MIN_WORDS = 12


def paragraphs(doc: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", doc):
        text = " ".join(para.split())
        if len(text.split()) >= MIN_WORDS and not text.startswith((">>>", "..")):
            out.append(text)
    return out


def main() -> None:
    warnings.simplefilter("ignore")
    seen: set[str] = set()
    rows = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith(SKIP):
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # platform-specific modules
            continue
        objs = [mod] + [
            v
            for _, v in sorted(vars(mod).items(), key=lambda kv: kv[0])
            if (inspect.isclass(v) or inspect.isfunction(v))
            and getattr(v, "__module__", None) == name
        ]
        for obj in objs:
            for para in paragraphs(inspect.getdoc(obj) or ""):
                if para not in seen:
                    seen.add(para)
                    rows.append({"text": para, "source": name})
    out = Path(__file__).with_name("train.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} paragraphs, {out.stat().st_size} bytes -> {out}")


if __name__ == "__main__":
    main()
