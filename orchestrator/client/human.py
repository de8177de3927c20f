"""Text for people: durations, sizes, rates, ratios, money, aligned tables and
terminal-safe strings in ``ito``'s readable output. ``--json`` never goes through here:
it keeps every value at full precision and every string as sent.

Every string a tenant (or a server) controls, such as file, phase and check names,
messages and log lines, reaches the terminal through ``safe``: a control character,
an ANSI escape, a carriage return or a newline is printed as its escape (``\x1b``,
``\r``, ``\n``), so no run can clear the screen, rewrite a line or forge one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[ch]
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def safe(value: object) -> str:
    """``value`` as one terminal-safe line: every character that is not printable
    (C0/C1 controls, ESC, DEL, CR, LF, tab, bidi overrides and other format characters,
    unusual separators) becomes its escape."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def safe_lines(text: str) -> str:
    """Rendered output as it goes to the terminal: each line through ``safe`` (the
    renderers' own newlines kept), so a string a renderer failed to escape still cannot
    carry a control sequence."""
    return "\n".join(safe(line) for line in text.split("\n"))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "") -> str:
    """A left-aligned table under upper-case headers (``kubectl get``'s layout); every
    cell goes through ``safe``."""
    cells = [[safe(h).upper() for h in headers], *([safe(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        indent + "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in cells
    )


def pairs(rows: Iterable[tuple[object, object]], indent: str = "") -> str:
    """Aligned ``key   value`` lines without headers (``kubectl describe``'s layout)."""
    cells = [(safe(k), safe(v)) for k, v in rows]
    width = max((len(k) for k, _ in cells), default=0)
    return "\n".join(f"{indent}{k.ljust(width)}   {v}".rstrip() for k, v in cells)


def score(x: object) -> str:
    """An eval score to four significant digits ("3.231"); "-" when there is none."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return "-" if x is None else safe(x)
    return f"{x:.4g}"


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
    return (
        f"{v:.2f} {unit}"
        if abs(v) < 10
        else f"{v:.1f} {unit}"
        if abs(v) < 100
        else f"{v:.0f} {unit}"
    )


def rate(bytes_per_s: float) -> str:
    return f"{size(bytes_per_s)}/s"


def ratio(x: float) -> str:
    """0.92345 -> "92.3%"."""
    return f"{x * 100:.1f}%" if math.isfinite(x) else str(x)


def usd(x: float) -> str:
    """1234.5 -> "$1,234.50"; a cost that rounds to nothing but is not zero -> "< $0.01"."""
    return "< $0.01" if 0 < x < 0.005 else f"${x:,.2f}"


def count_rate(x: float, unit: str) -> str:
    """12345.678 tokens/s -> "12,346 tokens/s"; small rates keep two decimals."""
    return f"{x:,.0f} {unit}" if abs(x) >= 100 else f"{x:.2f} {unit}"


def value(key: str, v: object) -> str:
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
    if key.endswith("_per_s"):  # samples_per_s -> "8.49 samples/s"
        return count_rate(v, key.removesuffix("_per_s").rsplit("_", 1)[-1] + "/s")
    if key.endswith("_per_h"):
        return count_rate(v, "/h")
    if key == "bytes" or key.endswith("_bytes") or key.startswith("bytes_"):
        return size(v)
    if key.endswith("_usd") or key.startswith("cost"):
        return usd(v)
    if key.startswith("usd_per_"):  # usd_per_gpu_hour -> "$2.50/gpu hour"
        return f"{usd(v)}/{key.removeprefix('usd_per_').replace('_', ' ')}"
    if key.endswith("_gib"):
        return f"{v:.4g} GiB"
    if key == "hours":
        return duration(v * 3600)
    if key.endswith("_s") or key in ("seconds", "elapsed"):
        return duration(v)
    if key in ("goodput", "ratio") or key.endswith("_ratio"):
        return ratio(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"{v:,}" if abs(v) >= 10_000 else str(v)
