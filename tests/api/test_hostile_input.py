"""Hostile input cannot stall the API or crash it: linear secret scans, tenant data
never read whole into the server, and a 4xx with a stable code for absurd numbers,
nesting and line lengths. The server tests run a real ``ito-backend serve``."""

from __future__ import annotations

import hashlib
import json
import re
import re._constants as sre_constants  # the stdlib's regex parser (sre_parse is deprecated)
import re._parser as sre_parse
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import Backend
from helpers.manifests import example_manifest, manifest_payload
from helpers.tenants import Tenant, make_tenant

from orchestrator import redact
from orchestrator.gates import manifest as manifest_gate
from stages.post_training.data import MAX_LINE_BYTES

from .conftest import Api, code_of

# A deadline, not a speed claim: with the old URI pattern this string cost ~20 s of
# one core per request (quadratic in its length, GIL held), so four at once pinned
# every request thread for over a minute.
REQUEST_DEADLINE_S = 15.0
CRAFTED = "a://a:" + "a" * 60_000
MB = 1 << 20


def _scan_patterns() -> list[re.Pattern[str]]:
    return [p for _, p in redact._SECRET_VALUES] + [
        manifest_gate._SECRET_KEY,
        manifest_gate._SAFE_KEY,
        redact._ID,
    ]


def _unbounded(tree: Any) -> bool:
    """Whether a parsed regex has a repeat without an upper bound anywhere in it."""
    for op, av in tree:
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            _low, high, sub = av
            if high == sre_constants.MAXREPEAT or _unbounded(sub):
                return True
        elif op in (sre_constants.SUBPATTERN,):
            if _unbounded(av[-1]):
                return True
        elif op == sre_constants.BRANCH:
            if any(_unbounded(alt) for alt in av[1]):
                return True
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT) and _unbounded(av[1]):
            return True
    return False


@pytest.mark.parametrize("pattern", _scan_patterns(), ids=lambda p: p.pattern[:24])
def test_every_scan_pattern_has_bounded_repeats(pattern: re.Pattern[str]) -> None:
    # Bounded repeats after an anchor keep each scan linear in the text (an unbounded
    # run before a literal re-scans the run from every start position).
    assert not _unbounded(sre_parse.parse(pattern.pattern, pattern.flags)), pattern.pattern


def _plan(url: str, t: Tenant, m: dict[str, Any] | bytes) -> httpx.Response:
    return httpx.post(
        url + "/v1/plans",
        json={"booking_id": t.booking_id, **manifest_payload(m)},
        headers={"Authorization": f"Bearer {t.submitter}"},
        timeout=REQUEST_DEADLINE_S,
    )


@pytest.mark.slow
def test_crafted_scan_string_does_not_stall_another_tenant(
    backend: Backend, tenant: Tenant, tmp_path: Path
) -> None:
    other = make_tenant(backend.db, "globex")
    m = example_manifest(tmp_path / "ckpt")
    m["notes"] = {CRAFTED[:4000]: CRAFTED}  # a key and a value; scanned as the text too
    t0 = time.perf_counter()
    assert _plan(backend.url, tenant, m).status_code == 422
    alone = time.perf_counter() - t0
    answers: list[tuple[int, str, float]] = []
    errors: list[BaseException] = []
    started = threading.Barrier(5)

    def hostile() -> None:
        try:
            started.wait()
            t0 = time.perf_counter()
            r = _plan(backend.url, tenant, m)
            answers.append((r.status_code, r.json()["error"]["code"], time.perf_counter() - t0))
        except BaseException as e:
            errors.append(e)

    # As many as the server has request threads: the old scan pinned all of them.
    threads = [threading.Thread(target=hostile) for _ in range(4)]
    for th in threads:
        th.start()
    started.wait()
    served: list[float] = []
    h = {"Authorization": f"Bearer {other.submitter}"}
    for _ in range(3):
        t0 = time.perf_counter()
        r = httpx.get(
            f"{backend.url}/v1/bookings/{other.booking_id}/eligibility",
            headers=h,
            timeout=REQUEST_DEADLINE_S,
        )
        assert r.status_code == 200, r.text
        served.append(time.perf_counter() - t0)
    for th in threads:
        th.join(REQUEST_DEADLINE_S * 2)
    assert not errors, errors
    # The unknown field is refused by the model after a clean (and quick) scan; what
    # is beyond the account's plan bound is refused before any scan.
    outcomes = [(s, c) for s, c, _ in answers]
    assert len(outcomes) == 4 and (422, "manifest_invalid") in outcomes, outcomes
    assert set(outcomes) <= {(422, "manifest_invalid"), (429, "too_many_concurrent_plans")}
    print(
        f"\ncrafted {len(CRAFTED)} B: alone {alone:.3f} s; x4 at once: answered in "
        f"{', '.join(f'{s:.3f}' for *_, s in answers)} s; other tenant served in "
        f"{', '.join(f'{s:.3f}' for s in served)} s"
    )


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MB):
            h.update(chunk)
    return h.hexdigest()


def _sft(uri: str, sha256: str) -> dict[str, Any]:
    return {
        "sft": {
            "data": {
                "uri": uri,
                "sha256": sha256,
                "provenance": {"source": "test", "license": "MIT"},
            },
            "steps": 1,
        }
    }


GOOD_ROW = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}


@pytest.mark.slow
def test_sparse_gigabyte_post_training_file_costs_the_server_no_memory(
    backend: Backend, tenant: Tenant, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    big = data / "sft.jsonl"
    with big.open("wb") as f:  # one good row, then a gigabyte hole: one endless line
        f.write(json.dumps(GOOD_ROW).encode() + b"\n")
        f.truncate(1 << 30)
    m = example_manifest(tmp_path / "ckpt", post_training=_sft(f"file://{big}", _sha256_of(big)))
    assert backend.proc is not None
    pid = backend.proc.pid
    _plan(backend.url, tenant, example_manifest(tmp_path / "ckpt"))  # warm the code path
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    before = _status(pid)
    r = _plan(backend.url, tenant, m)
    after = _status(pid)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "post_training_data_invalid"
    assert "sft.jsonl:2" in r.json()["error"]["message"]
    grew = after["VmHWM"] - before["VmRSS"]
    print(
        f"\n1 GiB sparse post-training file: server peak RSS grew {grew / MB:.1f} MiB "
        f"({before['VmRSS'] / MB:.1f} -> peak {after['VmHWM'] / MB:.1f} MiB)"
    )
    assert grew < 50 * MB


def _plan_raw(api: Api, raw: bytes) -> Any:
    return api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **manifest_payload(raw)},
        headers=api.h(api.t.submitter),
    )


def _with_field(api: Api, value_json: str) -> bytes:
    text = json.dumps(api.manifest())
    return (text[:-1] + ', "notes": ' + value_json + "}").encode()


@pytest.mark.parametrize(
    "value",
    [
        "9" * 5000,  # Python's own int() limit is 4300 digits: a ValueError
        "-" + "9" * 40,
        "[" * 100_000 + "]" * 100_000,  # beyond the parser's recursion limit
        "[" * 500 + "]" * 500,  # parsed, then refused by depth
        "[" + "[]," * 300_000 + "[]]",  # 1 MiB of values: refused by count
    ],
    ids=["5000-digits", "40-digits", "deep-100k", "deep-500", "300k-values"],
)
def test_absurd_manifest_values_are_manifest_invalid(api: Api, value: str) -> None:
    r = _plan_raw(api, _with_field(api, value))
    assert r.status_code == 422 and code_of(r) == "manifest_invalid", r.text


@pytest.mark.parametrize(
    "body",
    [
        '{"booking_id": "b", "manifest_b64": "e30=", "n": ' + "9" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["5000-digits", "deep"],
)
def test_absurd_request_bodies_are_bad_request(api: Api, body: str) -> None:
    r = api.client.post(
        "/v1/plans",
        content=body.encode(),
        headers={**api.h(api.t.submitter), "content-type": "application/json"},
    )
    assert r.status_code == 400 and code_of(r) == "bad_request", r.text


@pytest.mark.parametrize(
    "line",
    [
        b'{"messages": ' + b"9" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        # A valid row, only too long: the old reader took it whole.
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a" * MAX_LINE_BYTES},
                    {"role": "assistant", "content": "b"},
                ]
            }
        ).encode(),
    ],
    ids=["5000-digits", "deep", "long-line"],
)
def test_absurd_post_training_lines_are_post_training_data_invalid(
    api: Api, tmp_path: Path, line: bytes
) -> None:
    path = tmp_path / "data" / "sft.jsonl"
    path.parent.mkdir()
    path.write_bytes(json.dumps(GOOD_ROW).encode() + b"\n" + line + b"\n")
    m = api.manifest(post_training=_sft(f"file://{path}", _sha256_of(path)))
    r = _plan_raw(api, json.dumps(m).encode())
    assert r.status_code == 422 and code_of(r) == "post_training_data_invalid", r.text
    assert "sft.jsonl:2" in r.json()["error"]["message"]


def test_the_crafted_string_is_no_secret_and_scans_quickly() -> None:
    # In-process, the scan alone: the figure for the record (no timing assertion).
    tree = {"notes": {CRAFTED[:4000]: CRAFTED}}
    t0 = time.perf_counter()
    assert manifest_gate.find_secrets(tree) == []
    assert redact.value_kind(json.dumps(tree)) is None
    print(f"\nscan of {len(CRAFTED) + 4000} B: {time.perf_counter() - t0:.4f} s")
