"""Property: any mutation of a valid manifest is accepted or refused with a stable code,
never an unexpected exception (which the API would turn into a 500)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from helpers.manifests import example_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.gates.manifest import parse_manifest
from orchestrator.gates.validation import validate
from orchestrator.settings import Settings
from stages.errors import ItoError

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3)
    ),
    max_leaves=6,
)
BOOKING = {
    "booking_id": "bk",
    "gpu_sku": "H100-SXM",
    "gpus_per_node": 8,
    "node_count": 1,
    "fabric": "ib-ndr",
    "region": "eu",
}
BASE = example_manifest("/tmp/ito-fuzz-ckpt")


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


PATHS = _paths(BASE)


@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), JSON), min_size=1, max_size=3))
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_mutated_manifests_never_crash(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    m = copy.deepcopy(BASE)
    for path, value in edits:
        node = m
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced the parent
    raw = json.dumps(m).encode()
    s = Settings(db_path=Path("/nonexistent.db"))
    try:
        parsed = parse_manifest(raw)
        validate(s, parsed.model, BOOKING, remaining_term_h=24.0)
    except ItoError:
        pass
