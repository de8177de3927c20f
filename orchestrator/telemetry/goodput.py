"""Goodput telemetry, computed from a run's persisted events.

Goodput is productive step time over elapsed wall time since the run started.
Productive time counts each committed optimizer step once (replica groups step in
lock-step, so the same step number reported by several groups is one interval);
when a step is redone after an approved restart, only its last execution counts,
since the first one's work was thrown away. Badput is attributed from the
``PhaseEvent`` spans stages emit (start-up, checkpoint blocking, failure recovery,
evaluation); whatever elapsed time is neither productive nor attributed is idle.
Each second is attributed once: a step's own time (the ``seconds`` before its event's
``ts``) is productive whatever span covers it, and where spans of different causes
overlap the narrower cause wins (``ATTRIBUTION_ORDER``): the driver's stage-long
start-up span of a post-training stage holds that stage's steps and evaluations, which
count as such. Productive time plus every cause of badput is then the elapsed time.

Each interruption reports two durations from the failure (``failed_at``: the lost
process's end as Ray recorded it, else the last poll it answered): ``detect_s`` until
the run knew (``detected_at``) and ``recover_s`` until it trained in the full quorum
again (``recovered_at``). Without a failure time (a loss spike) recovery counts from
detection and there is no ``detect_s``.

A resize of the run's replica groups to its booking (``ResizeEvent``) is its own
cause, ``resize``: from the booking's change to the first step with the new group
count (the event's ``seconds``), less the steps the other groups committed meanwhile.
Not ``recovery``: nothing failed (recovery's detect and recover times stay a measure
of faults), and the time is the tenant's booking change, priced as such. The run's
replica groups (``replica_groups``) and GPU-hours (``gpu_hours``: groups x ranks per
group, piecewise, the count changing at each applied resize) follow the resizes.

The same numbers feed ``GET /v1/runs/{id}/metrics``, ``ito metrics`` and the
Prometheus exporter at ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, Field

from stages.event_buffer import as_int, expand_steps

BADPUT_KINDS = ("startup", "checkpoint_blocking", "recovery", "resize", "evaluation", "idle")
# Which cause an instant covered by spans of several causes counts as: the narrowest
# first, start-up (the catch-all around a whole stage) last.
ATTRIBUTION_ORDER = (
    "recovery",
    "resize",
    "checkpoint_blocking",
    "evaluation",
    "idle",
    "startup",
)
# What a stage's latest ``ProgressEvent`` contributes (e.g. data prep over a corpus).
PROGRESS_FIELDS = (
    "stage",
    "step",
    "step_index",
    "steps",
    "tasks_done",
    "tasks_total",
    "docs_done",
    "docs_total",
    "bytes_done",
    "bytes_total",
    "elapsed_s",
    "eta_s",
    "ts",
)


# Interruptions listed one by one (/metrics gauges included): the latest this many.
MAX_LISTED_INTERRUPTIONS = 100


class InterruptionTiming(BaseModel):
    """One interruption's detect and recover seconds (None: unknown or not yet)."""

    index: int
    kind: str
    replica_group: int | None = None
    detect_s: float | None = None
    recover_s: float | None = None


class ResizeTiming(BaseModel):
    """One resize as the trainer reported it last (its latest action)."""

    request_id: str
    action: str
    groups_before: int
    groups_after: int
    ts: float
    step: int | None = None
    # From the booking's change to the first step with the new count (or the pause).
    seconds: float | None = None
    reason: str = ""


class RunMetrics(BaseModel):
    elapsed_s: float = 0.0
    productive_s: float = 0.0
    goodput: float = 0.0
    badput_s: dict[str, float] = Field(default_factory=lambda: dict.fromkeys(BADPUT_KINDS, 0.0))
    steps_committed: int = 0
    steps_uncommitted: int = 0
    last_step: int | None = None
    last_loss: float | None = None
    tokens: int = 0
    tokens_per_s: float = 0.0
    interruptions: int = 0
    interruptions_recovered: int = 0
    interruption_rate_per_h: float = 0.0
    # Per interruption with a failure time, in event order (failure -> detection).
    detect_s: list[float] = Field(default_factory=list)
    # Per recovered interruption (failure, else detection -> back in the full quorum).
    recover_s: list[float] = Field(default_factory=list)
    # The latest MAX_LISTED_INTERRUPTIONS interruptions, each with both durations.
    interruption_timings: list[InterruptionTiming] = Field(default_factory=list)
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_bytes_per_s: float = 0.0
    checkpoint_blocking_s: float = 0.0
    # The latest progress report of a long stage step, None until one came.
    stage_progress: dict[str, Any] | None = None
    # Every scored check of every phase's eval battery: phase, check, score, passed.
    eval_scores: list[dict[str, Any]] = Field(default_factory=list)
    # Post-training's rollout fleet: the latest RLVR gauges (rollout_samples_per_s,
    # trainer_idle_frac, rollout_idle_frac, weight_sync_s, staleness_min/mean/max,
    # drop_rate, mean_reward, ...), from its ``metrics`` events.
    post_training: dict[str, float] = Field(default_factory=dict)
    # The run's replica groups now (the plan's, then each applied resize's), None
    # when unknown; its resizes; its GPU-hours at the group counts it had.
    replica_groups: int | None = None
    resizes: list[ResizeTiming] = Field(default_factory=list)
    gpu_hours: float | None = None
    # Those GPU-hours at the booking's price per GPU-hour (gates.costing).
    gpu_cost_usd: float | None = None


Spans = list[tuple[float, float]]


def _merge_spans(spans: Iterable[tuple[float, float]]) -> Spans:
    merged: Spans = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _uncovered_s(spans: Spans, cover: Spans) -> float:
    """Seconds of the merged ``spans`` outside the merged ``cover``."""
    total = 0.0
    i = 0
    for start, end in spans:
        t = start
        while i < len(cover) and cover[i][1] <= t:
            i += 1
        j = i
        while j < len(cover) and cover[j][0] < end:
            if cover[j][0] > t:
                total += cover[j][0] - t
            t = max(t, cover[j][1])
            j += 1
        total += max(0.0, end - t)
    return total


def compute_run_metrics(
    events: Iterable[Mapping[str, Any]],
    *,
    started_at: float,
    now: float,
    planned_groups: int | None = None,
    ranks_per_group: int | None = None,
) -> RunMetrics:
    """Fold a run's events (dicts as persisted) into its telemetry at time ``now``.

    ``started_at`` is when the run was accepted; ``now`` is the end of the run for a
    finished run, or the current time for a live one. ``planned_groups`` and
    ``ranks_per_group`` (the run's plan) start its group count and GPU-hours.
    """
    m = RunMetrics()
    last_by_step: dict[tuple[str, str, int], Mapping[str, Any]] = {}
    phase_spans: dict[str, list[tuple[float, float]]] = {k: [] for k in BADPUT_KINDS}
    ckpt_total_s = 0.0
    resizes: dict[str, ResizeTiming] = {}
    regroups: list[tuple[float, int]] = []  # (when, groups from then on)
    for ev in events:
        kind = ev.get("kind")
        if kind == "step":
            if ev.get("committed"):
                # Every replica group's rank 0 reports the same committed step with the
                # whole quorum's tokens, and a step redone after a restart is reported
                # again: the last report of each step is the one that counts.
                # A lagging buffer may have merged a run of steps into one event.
                # Post-training's sft and dpo steps count from 0 again, each its own
                # phase: a step is keyed by its stage and phase too.
                for one in expand_steps(dict(ev)):
                    key = (
                        str(one.get("stage", "")),
                        str(one.get("phase", "")),
                        as_int(one["step"]),
                    )
                    last_by_step[key] = one
                m.last_loss = float(ev["loss"])
                m.last_step = int(ev["step"])
            else:
                m.steps_uncommitted += 1
        elif kind == "phase" and ev.get("phase") in phase_spans:
            phase_spans[ev["phase"]].append((float(ev["start"]), float(ev["end"])))
        elif kind == "interruption":
            m.interruptions += 1
            detected = float(ev["detected_at"])
            failed = ev.get("failed_at")
            since = detected if failed is None else float(failed)
            timing = InterruptionTiming(
                index=m.interruptions - 1,
                kind=str(ev.get("interruption_kind", "")),
                replica_group=ev.get("replica_group"),
            )
            if failed is not None:
                timing.detect_s = max(0.0, detected - since)
                m.detect_s.append(timing.detect_s)
            if ev.get("recovered_at") is not None:
                m.interruptions_recovered += 1
                timing.recover_s = max(0.0, float(ev["recovered_at"]) - since)
                m.recover_s.append(timing.recover_s)
            m.interruption_timings.append(timing)
            del m.interruption_timings[:-MAX_LISTED_INTERRUPTIONS]
        elif kind == "resize":
            resize = ResizeTiming.model_validate(
                {k: ev[k] for k in ResizeTiming.model_fields if ev.get(k) is not None}
            )
            resizes.pop(resize.request_id, None)  # listed in the order of their last news
            resizes[resize.request_id] = resize
            if resize.action in ("applied", "paused"):
                regroups.append((resize.ts, resize.groups_after))
                if resize.seconds is not None:
                    phase_spans["resize"].append((resize.ts - resize.seconds, resize.ts))
        elif kind == "progress":
            m.stage_progress = {k: ev.get(k) for k in PROGRESS_FIELDS}
        elif kind == "eval":
            if ev.get("score") is not None:
                m.eval_scores.append(
                    {
                        "phase": ev["phase"],
                        "check": ev["check"],
                        "score": float(ev["score"]),
                        "passed": bool(ev.get("passed")),
                    }
                )
        elif kind == "checkpoint" and ev.get("closes_phase"):
            continue  # a phase end re-announcing a checkpoint already counted
        elif kind == "metrics" and ev.get("scope") == "rlvr":
            m.post_training.update({str(k): float(v) for k, v in ev["values"].items()})
        elif kind == "checkpoint":
            m.checkpoints += 1
            m.checkpoint_bytes += int(ev["bytes"])
            ckpt_total_s += float(ev["total_s"])
            m.checkpoint_blocking_s += float(ev["blocking_s"])
    m.steps_committed = len(last_by_step)
    m.tokens = sum(int(ev.get("tokens", 0)) for ev in last_by_step.values())
    m.elapsed_s = max(0.0, now - started_at)
    m.productive_s = sum(float(ev["seconds"]) for ev in last_by_step.values())
    # A step's own time: the ``seconds`` before its event was made.
    cover = _merge_spans(
        (float(ev["ts"]) - float(ev["seconds"]), float(ev["ts"]))
        for ev in last_by_step.values()
        if "ts" in ev
    )
    first_step_at = cover[0][0] if cover else None
    attributed = 0.0
    for kind in ATTRIBUTION_ORDER:
        spans = _merge_spans(
            (max(start, started_at), min(end, now)) for start, end in phase_spans[kind]
        )
        m.badput_s[kind] = _uncovered_s(spans, cover)
        attributed += m.badput_s[kind]
        cover = _merge_spans([*cover, *spans])
    m.badput_s["idle"] += max(0.0, m.elapsed_s - m.productive_s - attributed)
    if m.elapsed_s > 0:
        m.goodput = min(1.0, m.productive_s / m.elapsed_s)
        m.tokens_per_s = m.tokens / m.elapsed_s
        m.interruption_rate_per_h = m.interruptions / (m.elapsed_s / 3600.0)
    if ckpt_total_s > 0:
        m.checkpoint_bytes_per_s = m.checkpoint_bytes / ckpt_total_s
    m.resizes = list(resizes.values())[-MAX_LISTED_INTERRUPTIONS:]
    _group_count(m, first_step_at, regroups, planned_groups, ranks_per_group, now)
    return m


def _group_count(
    m: RunMetrics,
    first_step_at: float | None,
    regroups: list[tuple[float, int]],
    planned: int | None,
    ranks: int | None,
    now: float,
) -> None:
    """The run's group count now and its GPU-hours from its first step on, the count
    changing at each applied resize (a pause: 0 groups, no GPUs)."""
    m.replica_groups = regroups[-1][1] if regroups else planned
    if planned is None or ranks is None or first_step_at is None:
        return
    t, groups, group_s = first_step_at, planned, 0.0
    for when, after in sorted(regroups):
        if when > t:
            group_s += groups * (min(when, now) - t)
            t = when
        groups = after
    group_s += groups * max(0.0, now - t)
    m.gpu_hours = group_s * ranks / 3600.0


def aggregate(runs: Iterable[RunMetrics]) -> RunMetrics:
    """Per-booking totals: goodput is pooled time, not a mean of ratios."""
    out = RunMetrics()
    ckpt_s = 0.0
    for r in runs:
        out.elapsed_s += r.elapsed_s
        out.productive_s += r.productive_s
        for k, v in r.badput_s.items():
            out.badput_s[k] += v
        out.steps_committed += r.steps_committed
        out.steps_uncommitted += r.steps_uncommitted
        out.tokens += r.tokens
        out.interruptions += r.interruptions
        out.interruptions_recovered += r.interruptions_recovered
        out.checkpoints += r.checkpoints
        out.checkpoint_bytes += r.checkpoint_bytes
        out.checkpoint_blocking_s += r.checkpoint_blocking_s
        if r.checkpoint_bytes_per_s:
            ckpt_s += r.checkpoint_bytes / r.checkpoint_bytes_per_s
    if out.elapsed_s > 0:
        out.goodput = out.productive_s / out.elapsed_s
        out.tokens_per_s = out.tokens / out.elapsed_s
        out.interruption_rate_per_h = out.interruptions / (out.elapsed_s / 3600.0)
    if ckpt_s > 0:
        out.checkpoint_bytes_per_s = out.checkpoint_bytes / ckpt_s
    return out
