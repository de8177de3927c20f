"""Every number and list a tenant sets in a manifest has an upper bound.

The test walks the manifest model itself, so a field added later without a bound
fails here instead of becoming an unbounded timeout, count or size (each of which
is time, memory or money on the booking).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from orchestrator.gates.manifest import Manifest

CONTAINERS = (list, tuple, set, frozenset, dict)


def _has(metadata: list[Any], kinds: tuple[type, ...]) -> bool:
    return any(isinstance(m, kinds) for m in metadata)


def _leaves(tp: Any, metadata: list[Any]) -> Iterator[tuple[Any, list[Any]]]:
    """(type, constraints) of every leaf under ``tp``: unions unpacked, Annotated
    constraints carried to the leaf they constrain."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, *extra = typing.get_args(tp)
        found = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        yield from _leaves(inner, metadata + found)
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            yield from _leaves(arg, metadata)
    elif origin in CONTAINERS:
        yield origin, metadata
        for arg in typing.get_args(tp)[1:] if origin is dict else typing.get_args(tp):
            yield from _leaves(arg, [])  # an item's bounds are its own
    else:
        yield tp, metadata


def _literal_keys(tp: Any) -> bool:
    """A dict keyed by a Literal is as long as its key set at most."""
    for leaf in (tp, *typing.get_args(tp)):
        if typing.get_origin(leaf) is dict:
            return typing.get_origin(typing.get_args(leaf)[0]) is typing.Literal
    return False


def unbounded(model: type[BaseModel], path: str = "$", seen: set[type] | None = None) -> list[str]:
    seen = set() if seen is None else seen
    if model in seen:
        return []
    seen.add(model)
    found: list[str] = []
    for name, field in model.model_fields.items():
        where = f"{path}.{name}"
        for tp, metadata in _leaves(field.annotation, list(field.metadata)):
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                found += unbounded(tp, where, seen)
            elif tp in (int, float) and not _has(metadata, (at.Le, at.Lt)):
                found.append(f"{where} ({tp.__name__}: no upper bound)")
            elif (
                tp in CONTAINERS
                and not _has(metadata, (at.MaxLen,))
                and not _literal_keys(field.annotation)
            ):
                found.append(f"{where} ({tp.__name__}: no max_length)")
    return found


def test_every_tenant_set_number_and_list_in_the_manifest_has_an_upper_bound() -> None:
    assert unbounded(Manifest) == []


def test_the_walk_finds_an_unbounded_field() -> None:
    class Inner(BaseModel):
        timeout_s: float
        ok: int = 0

    class Outer(BaseModel):
        inner: Inner
        items: list[int]
        weights: dict[str, typing.Annotated[float, at.Le(1)]]

    assert sorted(unbounded(Outer)) == [
        "$.inner.ok (int: no upper bound)",
        "$.inner.timeout_s (float: no upper bound)",
        "$.items (int: no upper bound)",
        "$.items (list: no max_length)",
        "$.weights (dict: no max_length)",
    ]
