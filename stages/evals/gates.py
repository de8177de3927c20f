"""The gate: a battery result against thresholds and the previous phase's result.

A check passes when it has a finite score, within ``min``/``max``, and not worse than
the previous result of the same check by more than ``max_regression`` (in the
check's bad direction). A check that errored, timed out or gave no number fails,
thresholded or not: the whole battery must run. Nothing here can be overridden.
"""

from __future__ import annotations

from pydantic import BaseModel

from stages.evals.battery import BatteryResult
from stages.evals.config import GateThreshold
from stages.events import EvalEvent


class CheckVerdict(BaseModel):
    check: str
    phase: str
    score: float | None
    passed: bool
    reason: str = ""
    min: float | None = None
    max: float | None = None
    max_regression: float | None = None
    previous: float | None = None


class GateDecision(BaseModel):
    battery: str
    phase: str
    passed: bool
    checks: list[CheckVerdict]
    task_files: dict[str, str]

    @property
    def failing(self) -> list[CheckVerdict]:
        return [c for c in self.checks if not c.passed]

    def events(self, *, phase: str, step: int | None, stage: str = "") -> list[EvalEvent]:
        """One ``EvalEvent`` a check, as a gate is reported (``ito status`` draws
        them): the curriculum phase's battery at its closing step, or a post-training
        objective's battery under the objective's gate phase."""
        return [
            EvalEvent(
                stage=stage,
                phase=phase,
                battery=self.battery,
                check=v.check,
                score=v.score,
                passed=v.passed,
                reason=v.reason,
                min=v.min,
                max=v.max,
                max_regression=v.max_regression,
                previous=v.previous,
                step=step,
            )
            for v in self.checks
        ]

    def summary(self) -> str:
        if self.passed:
            return f"phase {self.phase}: battery {self.battery} passed"
        parts = [
            f"{c.check}={'none' if c.score is None else f'{c.score:.4g}'} ({c.reason})"
            for c in self.failing
        ]
        return f"phase {self.phase}: battery {self.battery} failed: " + "; ".join(parts)


def evaluate_gates(
    result: BatteryResult, thresholds: list[GateThreshold], previous: BatteryResult | None = None
) -> GateDecision:
    verdicts: list[CheckVerdict] = []
    changed = (
        previous is not None
        and previous.battery == result.battery
        and previous.task_files != result.task_files
    )
    by_check: dict[str, list[GateThreshold]] = {}
    for t in thresholds:
        by_check.setdefault(t.metric, []).append(t)
    for name in sorted(set(by_check) - {c.name for c in result.checks}):
        verdicts.append(
            CheckVerdict(
                check=name,
                phase=result.phase,
                score=None,
                passed=False,
                reason=f"battery {result.battery} has no check {name}",
            )
        )
    for c in result.checks:
        base = CheckVerdict(check=c.name, phase=result.phase, score=c.score, passed=True)
        if c.status != "ok" or c.score is None:
            verdicts.append(
                base.model_copy(
                    update={"passed": False, "reason": f"{c.status}: {c.error}".strip()}
                )
            )
            continue
        prev_check = previous.check(c.name) if previous is not None else None
        prev = prev_check.score if prev_check is not None else None
        ts = by_check.get(c.name) or []
        if not ts:
            verdicts.append(base.model_copy(update={"reason": "ran (no bound)"}))
        for t in ts:
            v = base.model_copy(
                update={
                    "min": t.min,
                    "max": t.max,
                    "max_regression": t.max_regression,
                    "previous": prev,
                }
            )
            reasons = []
            if t.min is not None and c.score < t.min:
                reasons.append(f"below min {t.min:g}")
            if t.max is not None and c.score > t.max:
                reasons.append(f"above max {t.max:g}")
            if t.max_regression is not None and prev is not None:
                worse = (prev - c.score) if c.higher_is_better else (c.score - prev)
                if worse > t.max_regression:
                    reasons.append(
                        f"regressed {worse:.4g} vs previous {prev:.4g} "
                        f"(allowed {t.max_regression:g})"
                    )
            v.passed = not reasons
            v.reason = "; ".join(reasons) or "within bounds"
            verdicts.append(v)
    if changed:
        verdicts.append(
            CheckVerdict(
                check="battery_files",
                phase=result.phase,
                score=None,
                passed=False,
                reason="the battery's files changed since the previous phase (sha256)",
            )
        )
    return GateDecision(
        battery=result.battery,
        phase=result.phase,
        passed=all(v.passed for v in verdicts),
        checks=verdicts,
        task_files=result.task_files,
    )
