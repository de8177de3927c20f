"""Numbers for people: durations, sizes, rates, ratios and money in ``ito``'s readable
output. ``--json`` never goes through here: it keeps every value at full precision."""

from __future__ import annotations

import json
import math
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def duration(seconds: float) -> str:
    """0.0103 -> "10.3 ms"; 1.2345 -> "1.23 s"; 252 -> "4 min 12 s"; 7500 -> "2 h 05 min"."""
    if not math.isfinite(seconds):
        return str(seconds)
    s = abs(seconds)
    sign = "-" if seconds < 0 else ""
    if s == 0:
        return "0 s"
    if s < 0.01:
        return f"{sign}{s * 1000:.2f} ms"
    if s < 1:
        return f"{sign}{s * 1000:.1f} ms" if s < 0.1 else f"{sign}{s * 1000:.0f} ms"
    if s < 60:
        return f"{sign}{s:.2f} s" if s < 10 else f"{sign}{s:.1f} s"
    if s < 3600:
        m, rest = divmod(round(s), 60)
        return f"{sign}{m} min {rest:02d} s"
    h, rest = divmod(round(s) // 60, 60)
    return f"{sign}{h} h {rest:02d} min"


def size(n: float) -> str:
    """7961073 -> "7.59 MiB"; 512 -> "512 B" (binary units)."""
    if not math.isfinite(n):
        return str(n)
    v, unit = float(n), _UNITS[0]
    for unit in _UNITS:
        if abs(v) < 1024 or unit == _UNITS[-1]:
            break
        v /= 1024
    if unit == "B":
        return f"{v:.0f} B"
    return f"{v:.2f} {unit}" if abs(v) < 10 else f"{v:.1f} {unit}" if abs(v) < 100 \
        else f"{v:.0f} {unit}"


def rate(bytes_per_s: float) -> str:
    return f"{size(bytes_per_s)}/s"


def ratio(x: float) -> str:
    """0.92345 -> "92.3%"."""
    return f"{x * 100:.1f}%" if math.isfinite(x) else str(x)


def usd(x: float) -> str:
    return f"${x:,.2f}"


def count_rate(x: float, unit: str) -> str:
    """12345.678 tokens/s -> "12,346 tokens/s"; small rates keep two decimals."""
    return f"{x:,.0f} {unit}" if abs(x) >= 100 else f"{x:.2f} {unit}"


def value(key: str, v: Any) -> str:
    """One metric or checkpoint field, formatted by what its name says it is."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(value(key, x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k} {value(key, x)}" for k, x in v.items())
    if not isinstance(v, int | float):
        return json.dumps(v, default=str)
    if key.endswith("bytes_per_s"):
        return rate(v)
    if key.endswith("tokens_per_s"):
        return count_rate(v, "tokens/s")
    if key.endswith("_per_h"):
        return count_rate(v, "/h")
    if key == "bytes" or key.endswith("_bytes") or key.startswith("bytes_"):
        return size(v)
    if key.endswith("_usd") or key.startswith("cost"):
        return usd(v)
    if key.endswith("_s") or key in ("seconds", "elapsed"):
        return duration(v)
    if key in ("goodput", "ratio") or key.endswith("_ratio"):
        return ratio(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"{v:,}" if abs(v) >= 10_000 else str(v)
