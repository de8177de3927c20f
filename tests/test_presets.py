from __future__ import annotations

import pytest

from stages.errors import ErrorCode, ItoError
from stages.presets import list_model_presets, load_model_preset


def test_llama3_param_counts_match_published_sizes() -> None:
    assert round(load_model_preset("llama3-8b").num_params / 1e9, 2) == 8.03
    assert round(load_model_preset("llama3-70b").num_params / 1e9, 1) == 70.6
    assert round(load_model_preset("llama3-405b").num_params / 1e9) == 406


def test_moe_counts_active_params_separately() -> None:
    p = load_model_preset("mixtral-8x7b")
    assert p.active_params < p.num_params / 3


def test_unknown_preset_has_stable_code() -> None:
    with pytest.raises(ItoError) as e:
        load_model_preset("../etc/passwd")
    assert e.value.code == ErrorCode.model_preset_unknown
    assert "llama-tiny" in list_model_presets()
