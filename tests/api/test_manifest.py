"""The manifest model, its digest and the secret scan."""

from __future__ import annotations

import json

import pytest
from helpers.manifests import EXAMPLE, example_manifest

from orchestrator.gates.manifest import Manifest, find_secrets, manifest_id, parse_manifest
from stages.errors import ErrorCode, ItoError


def _raw(m: dict) -> bytes:
    return json.dumps(m).encode()


def test_example_is_valid_and_digest_is_of_exact_bytes() -> None:
    raw = EXAMPLE.read_bytes()
    p = parse_manifest(raw)
    assert isinstance(p.model, Manifest) and p.model.model.preset == "llama-tiny"
    assert p.manifest_id == manifest_id(p.digest) == "mf_" + p.digest[:24]
    # One byte of whitespace changes the digest: it is of the bytes, not the meaning.
    assert parse_manifest(raw + b"\n").digest != p.digest
    with pytest.raises(ItoError) as e:
        parse_manifest(raw, claimed_digest="f" * 64)
    assert e.value.code == ErrorCode.manifest_digest_mismatch


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.update(extra_field=1),
        lambda m: m["model"].update(unknown=1),
        lambda m: m.update(manifest_version=2),
        lambda m: m["training"].update(max_steps="50"),  # strict: no str -> int coercion
        lambda m: m["curriculum"]["phases"][0].update(token_fraction=0.5),
        lambda m: m.pop("budget"),
    ],
)
def test_strict_model(mutate) -> None:  # type: ignore[no-untyped-def]
    m = example_manifest()
    mutate(m)
    with pytest.raises(ItoError) as e:
        parse_manifest(_raw(m))
    assert e.value.code == ErrorCode.manifest_invalid


def test_duplicate_keys_refused() -> None:
    raw = b'{"manifest_version": 1, "manifest_version": 1}'
    with pytest.raises(ItoError) as e:
        parse_manifest(raw)
    assert e.value.code == ErrorCode.manifest_invalid


def test_missing_provenance_has_its_own_code() -> None:
    m = example_manifest()
    del m["data"]["refs"][0]["provenance"]
    with pytest.raises(ItoError) as e:
        parse_manifest(_raw(m))
    assert e.value.code == ErrorCode.data_provenance_missing


SECRETS = [
    ("sk-" + "a1B2" * 8, "value"),
    ("ghp_" + "x" * 36, "value"),
    ("AKIA" + "ABCDEFGHIJKLMNOP", "value"),
    ("itok_0123456789abcdef_secretsecret", "value"),
    ("xoxb-1234567890-abcdefghij", "value"),
    ("Bearer abcdefghijklmnop", "value"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIE...", "value"),
    ("https://user:pa55word@example.com/data", "value"),
    ("hunter2", "password"),
    ("x", "api_key"),
    ("x", "hf_token"),
    ("x", "aws_secret_access_key"),
    ("x", "credentials"),
]


@pytest.mark.parametrize("secret, where", SECRETS)
def test_secrets_refused_and_not_echoed(secret: str, where: str) -> None:
    m = example_manifest()
    if where == "value":
        m["data"]["refs"][0]["provenance"]["source"] = f"see {secret}"
    else:
        m["data"]["refs"][0][where] = secret
    with pytest.raises(ItoError) as e:
        parse_manifest(_raw(m))
    assert e.value.code == ErrorCode.manifest_contains_secret
    assert secret not in e.value.message and secret not in str(e.value)


def test_escaped_secret_still_found() -> None:
    # JSON escapes cannot hide a key shape from the scan (it reads decoded strings).
    raw = EXAMPLE.read_bytes().replace(b'"CC0-1.0"', b'"\\u0073k-abcdefghijklmnopqrst"')
    with pytest.raises(ItoError) as e:
        parse_manifest(raw)
    assert e.value.code == ErrorCode.manifest_contains_secret


def test_no_false_positive_on_token_counts() -> None:
    m = example_manifest()
    # target_tokens / global_batch_tokens / max_completion_tokens are not secrets.
    assert find_secrets(m) == []
    assert find_secrets({"max_completion_tokens": 5, "tokenizer": "byte"}) == []


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b"[" * 40 + b"]" * 40,
    ],
)
def test_hostile_nesting_is_refused_not_crashing(raw: bytes) -> None:
    with pytest.raises(ItoError) as e:
        parse_manifest(raw)
    assert e.value.code == ErrorCode.manifest_invalid


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-1"])
def test_budget_must_be_finite_and_positive(value: bytes) -> None:
    raw = EXAMPLE.read_bytes().replace(b'"ceiling_usd": 5.0', b'"ceiling_usd": ' + value)
    assert raw != EXAMPLE.read_bytes()
    with pytest.raises(ItoError) as e:
        parse_manifest(raw)
    assert e.value.code == ErrorCode.manifest_invalid
