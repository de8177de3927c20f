"""Readable output formats numbers for people; --json keeps full precision."""

from __future__ import annotations

import json

import pytest

from orchestrator.client import human
from orchestrator.client.cli import _Out, _readable

CKPT = {"step": 20, "bytes": 7961073, "blocking_s": 0.010281820000045627,
        "total_s": 1.2345678, "bytes_per_s": 7961073.57, "path": "/ckpt/step-20"}


@pytest.mark.parametrize(("fn", "arg", "text"), [
    (human.duration, 0.010281820000045627, "10.3 ms"),
    (human.duration, 0.0004, "0.40 ms"),
    (human.duration, 1.2345, "1.23 s"),
    (human.duration, 252, "4 min 12 s"),
    (human.duration, 7500, "2 h 05 min"),
    (human.size, 512, "512 B"),
    (human.size, 7961073, "7.59 MiB"),
    (human.size, 3 * 2**30, "3.00 GiB"),
    (human.rate, 7961073.57, "7.59 MiB/s"),
    (human.ratio, 0.92345, "92.3%"),
    (human.usd, 1234.5, "$1,234.50"),
])
def test_formats(fn, arg, text: str) -> None:
    assert fn(arg) == text


def test_checkpoints_and_metrics_print_no_raw_floats() -> None:
    text = _readable("checkpoints", {"checkpoints": [CKPT]})
    assert text == ("step 20: 7.59 MiB, blocking 10.3 ms, total 1.23 s, 7.59 MiB/s  "
                    "/ckpt/step-20")
    metrics = {"goodput": 0.81234567, "elapsed_s": 87.123456, "tokens_per_s": 9091.2345,
               "checkpoint_bytes_per_s": 7961073.57, "badput_s": {"startup": 12.345678},
               "interruption_rate_per_h": 41.3793103, "tokens": 123456, "recover_s": [2.5]}
    text = _readable("metrics", metrics)
    assert "goodput: 81.2%" in text and "elapsed_s: 1 min 27 s" in text
    assert "tokens_per_s: 9,091 tokens/s" in text and "7.59 MiB/s" in text
    assert "badput_s: startup 12.3 s" in text and "41.38 /h" in text
    assert "recover_s: [2.50 s]" in text
    assert "0.81234567" not in text and "7961073.57" not in text


def test_json_output_keeps_full_precision(capsys) -> None:
    env = {"ok": True, "live_api_contacted": True, "notice": "",
           "data": {"checkpoints": [CKPT]}}
    _Out(as_json=True).final("checkpoints", env)
    assert json.loads(capsys.readouterr().out)["data"]["checkpoints"][0] == CKPT
