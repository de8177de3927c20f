"""Eval batteries and gates: ``run_battery`` scores a model on a fixed battery,
``evaluate_gates`` decides pass/fail against thresholds and the previous result.
Used by the curriculum (phase gates) and post-training (its own gates).

Exports resolve lazily: the API server imports ``stages.evals.config`` (battery
names, thresholds) for validation without importing torch or lm-eval.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Battery": "config",
    "BatteryCheck": "config",
    "GateThreshold": "config",
    "list_batteries": "config",
    "load_battery": "config",
    "BatteryResult": "battery",
    "CheckResult": "battery",
    "EvalSettings": "battery",
    "run_battery": "battery",
    "CheckVerdict": "gates",
    "GateDecision": "gates",
    "evaluate_gates": "gates",
}
__all__ = [
    "Battery",
    "BatteryCheck",
    "BatteryResult",
    "CheckResult",
    "CheckVerdict",
    "EvalSettings",
    "GateDecision",
    "GateThreshold",
    "evaluate_gates",
    "list_batteries",
    "load_battery",
    "run_battery",
]

if TYPE_CHECKING:
    from stages.evals.battery import BatteryResult, CheckResult, run_battery
    from stages.evals.config import (
        Battery,
        BatteryCheck,
        GateThreshold,
        list_batteries,
        load_battery,
    )
    from stages.evals.config import EvalRunSettings as EvalSettings
    from stages.evals.gates import CheckVerdict, GateDecision, evaluate_gates


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stages.evals' has no attribute {name!r}")
    return getattr(import_module(f"stages.evals.{_EXPORTS[name]}"), name)
