"""Server-side validation of the manifest's curriculum, and the phases' schedule that
``ito plan`` shows and the training stage executes (one function for both)."""

from __future__ import annotations

from typing import Any

from orchestrator.gates.manifest import Manifest
from stages.curriculum.schedule import CurriculumSchedule, schedule_curriculum
from stages.errors import ErrorCode, ItoError
from stages.evals.config import load_battery
from stages.presets import load_model_preset


def curriculum_schedule(m: Manifest) -> CurriculumSchedule:
    """The curriculum schedule of ``m``; raises ``eval_battery_unknown`` (a phase names no
    battery), ``eval_metric_unknown`` (a threshold on a check its battery does not
    produce) or ``curriculum_invalid`` (e.g. long_context not raising seq_len)."""
    for phase in m.curriculum.phases:
        battery = load_battery(phase.eval_battery)
        for gate in phase.gates:
            if gate.metric not in battery.check_names:
                raise ItoError(
                    ErrorCode.eval_metric_unknown,
                    f"phase {phase.name}: battery {battery.name} does not produce "
                    f"{gate.metric!r}; it produces {', '.join(battery.check_names)}",
                )
    preset = load_model_preset(m.model.preset)
    t = m.training
    return schedule_curriculum(
        m.curriculum,
        total_steps=t.steps,
        base_seq_len=t.seq_len,
        global_batch_tokens=t.global_batch_tokens,
        learning_rate=t.learning_rate,
        warmup_steps=t.warmup_steps,
        rope_theta=preset.rope_theta,
        head_dim=preset.head_dim,
        max_positions=preset.max_position_embeddings,
    )


def curriculum_report(schedule: CurriculumSchedule) -> dict[str, Any]:
    """What ``ito plan`` shows per phase."""
    return {
        "phases": [
            {
                "name": p.name,
                "kind": p.kind,
                "steps": [p.start_step, p.end_step],
                "token_budget": p.token_budget,
                "seq_len": p.seq_len,
                "data_weights": dict(p.data_weights),
                "battery": p.eval_battery,
                "checks": load_battery(p.eval_battery).check_names if p.eval_battery else [],
                "gates": [g.model_dump(mode="json", exclude_none=True) for g in p.gates],
                "lr_schedule": p.lr_schedule,
                "peak_lr": p.peak_lr,
                "warmup_steps": p.warmup_steps,
                "decay_steps": p.decay_steps,
                "rope_theta": p.rope_theta,
            }
            for p in schedule.phases
        ],
        "post_training": schedule.post_training,
    }
