"""A post-training objective's gate: its verdict (``check_gate``) and the checks it is
reported by (``objective_gate_events``), the curriculum phases' ``EvalEvent`` s, so
``ito status`` shows an objective's gate as it shows a phase's."""

from __future__ import annotations

from stages.evals.gates import GateDecision
from stages.events import EvalEvent
from stages.post_training.config import ObjectiveGate

# What an objective's gate shows beside its gate metric (scores without a bound): where
# the gated difference comes from.
GATE_CONTEXT: dict[str, tuple[str, ...]] = {
    "sft": ("nll_before", "nll_after"),
    "dpo": ("margin_before", "margin_after", "preference_accuracy"),
    "rlvr": ("reward_first", "reward_last", "staleness_max"),
}
# An objective's own gate (its metric >= min) is reported as this battery, beside the
# curriculum battery it may also name.
OBJECTIVE_BATTERY = "objective"


def gate_phase(objective: str) -> str:
    """The ``phase`` an objective's gate checks are reported under (``EvalEvent``), apart
    from any curriculum phase's name."""
    return f"post_training.{objective}"


def objective_gate_events(
    objective: str,
    gate: ObjectiveGate | None,
    metrics: dict[str, float],
    *,
    steps: int | None,
    battery: GateDecision | None = None,
) -> list[EvalEvent]:
    """An objective's gate as the curriculum phases report theirs (one ``EvalEvent`` a
    check, so ``ito status`` shows both alike): its gate metric with the bound and the
    verdict, the scores it comes from (no bound), and, when the objective names a
    battery, each of its checks (``battery``: the ``GateDecision`` on it)."""
    phase = gate_phase(objective)
    events: list[EvalEvent] = []
    if gate is not None:
        failed = check_gate(objective, gate, metrics)
        events.append(
            EvalEvent(
                phase=phase,
                battery=OBJECTIVE_BATTERY,
                check=gate.metric,
                score=metrics.get(gate.metric),
                passed=failed is None,
                reason=failed or "",
                min=gate.min,
                step=steps,
            )
        )
    events += [
        EvalEvent(
            phase=phase,
            battery=OBJECTIVE_BATTERY,
            check=name,
            score=metrics[name],
            passed=True,
            reason="ran (no bound)",
            step=steps,
        )
        for name in GATE_CONTEXT.get(objective, ())
        if name in metrics and (gate is None or name != gate.metric)
    ]
    if battery is not None:
        events += battery.events(phase=phase, step=steps)
    return events


def check_gate(objective: str, gate: ObjectiveGate | None, metrics: dict[str, float]) -> str | None:
    """None if the gate passes, else the reason."""
    if gate is None:
        return None
    if gate.metric not in metrics:
        return f"{objective}: gate metric {gate.metric!r} is not in the battery ({sorted(metrics)})"
    value = metrics[gate.metric]
    if not value >= gate.min:
        return f"{objective}: {gate.metric} = {value:.4g} < {gate.min:.4g}"
    return None
