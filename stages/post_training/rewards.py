"""Verifiable rewards and the registry a manifest names them from.

A reward function takes the completion text and the sample's reference answer
and returns a float. The manifest names one by registry name only (never a code
path: tenants cannot make the backend import arbitrary modules); operators add
their own with ``register_reward`` or through the ``ito_train.rewards`` entry-point
group.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from importlib.metadata import entry_points

from stages.errors import ErrorCode, ItoError

RewardFn = Callable[[str, str], float]
_REGISTRY: dict[str, RewardFn] = {}
ENTRY_POINT_GROUP = "ito_train.rewards"

# A number: optional sign, digits with optional thousands commas, optional decimals.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_FINAL = re.compile(r"####\s*(" + _NUMBER + r")\s*$")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANY = re.compile(r"(?<![\w.])(" + _NUMBER + r")(?![\w])")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def get_reward(name: str) -> RewardFn:
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ItoError(
            ErrorCode.reward_unknown,
            f"reward {name!r} is not registered (known: {', '.join(sorted(_REGISTRY))})",
        ) from None


def reward_names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def parse_number(text: str) -> Decimal | None:
    """A strict numeric value: ``#### N`` at the end, else ``\\boxed{N}``, else the
    last number in the text. Commas are thousands separators only (1,234 but not
    1,23); anything else is no number."""
    text = text.strip()
    m = _FINAL.search(text) or _BOXED.search(text)
    raw = m.group(1) if m else None
    if raw is None:
        found = _ANY.findall(text)
        raw = found[-1] if found else None
    if raw is None:
        return None
    try:
        return Decimal(raw.replace(",", ""))
    except InvalidOperation:
        return None


def reference_number(answer: str) -> Decimal | None:
    """GSM8K references end with ``#### N``; bare numbers are accepted too."""
    return parse_number(answer)


@register_reward("gsm8k_exact_match")
def gsm8k_exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion's final number equals the reference's, else 0.0."""
    want = reference_number(answer)
    got = parse_number(completion)
    return 1.0 if want is not None and got is not None and got == want else 0.0


@register_reward("first_number_match")
def first_number_match(completion: str, answer: str) -> float:
    """1.0 if the first number in the completion equals the reference (a strict,
    short-horizon variant for tiny models: no credit for guessing at the end)."""
    want = reference_number(answer)
    found = _ANY.findall(completion)
    if want is None or not found:
        return 0.0
    try:
        return 1.0 if Decimal(found[0].replace(",", "")) == want else 0.0
    except InvalidOperation:
        return 0.0
