"""The server refuses bad curricula with codes before any workload exists, and
``POST /v1/plans`` (``ito plan``) shows the phases."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, code_of


def _curriculum(*phases: dict[str, Any]) -> dict[str, Any]:
    return {"phases": list(phases)}


PRE = {
    "name": "pretrain",
    "kind": "pretrain",
    "token_fraction": 0.5,
    "seq_len": 64,
    "eval_battery": "smoke",
    "gates": [{"metric": "heldout_loss", "max": 9.0}],
}
LONG = {
    "name": "long",
    "kind": "long_context",
    "token_fraction": 0.5,
    "seq_len": 128,
    "eval_battery": "smoke",
    "gates": [{"metric": "heldout_loss", "max_regression": 0.5}],
}


@pytest.mark.parametrize(
    ("phases", "code"),
    [
        ([{**PRE, "eval_battery": "no-such-battery"}, LONG], "eval_battery_unknown"),
        ([{**PRE, "eval_battery": "gsm8k"}, LONG], "eval_battery_unknown"),  # a suite, no checks
        ([PRE, {**LONG, "gates": [{"metric": "mmlu_acc", "min": 0.3}]}], "eval_metric_unknown"),
        ([PRE, {**LONG, "seq_len": 64}], "curriculum_invalid"),  # long_context must raise it
        ([PRE, {**LONG, "seq_len": 32}], "curriculum_invalid"),
        ([PRE, {**LONG, "seq_len": 4096}], "curriculum_invalid"),  # beyond the model's positions
        ([PRE, {**LONG, "seq_len": 96}], "curriculum_invalid"),  # batch not a multiple
    ],
)
def test_bad_curricula_are_refused_with_codes(
    api: Api, phases: list[dict[str, Any]], code: str
) -> None:
    m = api.manifest(curriculum=_curriculum(*phases))
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **_payload(m)},
        headers=api.h(api.t.submitter),
    )
    assert code_of(r) == code
    # And a submission with a valid confirmation creates nothing.
    r = api.submit(manifest=m, idem=f"key-{code}-0001")
    assert code_of(r) == code
    assert not api.store.read("SELECT * FROM runs")


def test_an_override_field_is_not_a_manifest_field(api: Api) -> None:
    bad_gate = {**LONG, "gates": [{"metric": "heldout_loss", "skip": True}]}
    for phases in ([PRE, {**LONG, "override_gate": True}], [PRE, bad_gate]):
        m = api.manifest(curriculum=_curriculum(*phases))
        # Neither an approver can confirm it nor a submitter submit it.
        assert api.confirm(manifest=m)["error"]["code"] == "manifest_invalid"
        assert code_of(api.submit(manifest=m, ref="cref_none")) == "manifest_invalid"


def test_plan_shows_phases_with_budgets_seq_lens_and_batteries(api: Api) -> None:
    m = api.manifest(curriculum=_curriculum(PRE, LONG))
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **_payload(m)},
        headers=api.h(api.t.submitter),
    )
    body = r.json()
    assert body["ok"], body
    cur = body["data"]["validation"]["curriculum"]
    pre, long = cur["phases"]
    steps = m["training"]["max_steps"]
    gbt = m["training"]["global_batch_tokens"]
    assert pre["steps"] == [0, steps // 2] and long["steps"] == [steps // 2, steps]
    assert pre["token_budget"] + long["token_budget"] == steps * gbt
    assert (pre["seq_len"], long["seq_len"]) == (64, 128)
    assert pre["battery"] == long["battery"] == "smoke"
    assert "arith_mc_acc" in pre["checks"]
    assert long["rope_theta"] > pre["rope_theta"]  # the RoPE base scales with seq_len
    assert long["gates"] == [{"metric": "heldout_loss", "max_regression": 0.5}]
    # The CLI's readable plan lists them too.
    import re

    from orchestrator.client.render import readable

    rows = [
        re.split(r" {3,}", line.strip()) for line in readable("plan", body["data"]).splitlines()
    ]
    assert ["PHASE", "KIND", "STEPS", "TOKENS", "SEQ LEN", "BATTERY", "GATES"] in rows
    assert [r[:3] + r[4:] for r in rows if r[0] == long["name"]] == [
        [
            long["name"],
            "long_context",
            f"{steps // 2}-{steps}",
            "128",
            "smoke",
            "heldout_loss max_regression=0.5",
        ]
    ]


def _payload(m: dict[str, Any]) -> dict[str, str]:
    from helpers.manifests import manifest_payload

    return manifest_payload(m)


def test_a_tokenizer_folder_must_be_a_local_tokenizer(api: Api) -> None:
    from stages.hf import save_tokenizer, train_tokenizer

    for bad, code in (
        ("relative/tok", "path_not_local"),
        ("hf://org/tok", "path_not_local"),
        ("/nonexistent/tok", "path_outside_root"),
        (str(api.tmp), "tokenizer_invalid"),
    ):
        m = api.manifest()
        m["model"]["tokenizer_path"] = bad
        r = api.client.post(
            "/v1/plans",
            json={"booking_id": api.t.booking_id, **_payload(m)},
            headers=api.h(api.t.submitter),
        )
        assert code_of(r) == code, (bad, r.text)
    good = save_tokenizer(train_tokenizer([], vocab_size=260), api.tmp / "tok")
    m = api.manifest()
    m["model"]["tokenizer_path"] = f"file://{good}"
    r = api.client.post(
        "/v1/plans",
        json={"booking_id": api.t.booking_id, **_payload(m)},
        headers=api.h(api.t.submitter),
    )
    assert r.json()["ok"], r.json()
