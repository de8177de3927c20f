"""``ito``'s readable output: one renderer per command, small aligned tables with units
(``kubectl get`` / ``gh`` style). ``--json`` never comes here.

Every value from the server is a tenant's or the server's string, so each one is
printed through ``human.safe`` (tables do it per cell), and ``cli._Out`` passes the whole
text through ``human.safe_lines`` once more before it reaches the terminal.
"""

from __future__ import annotations

import json
import time
from typing import Any

from orchestrator.client import human
from orchestrator.client.human import safe, table
from orchestrator.client.render_plan import manifest_init, plan_response

# Metrics rendered as their own tables rather than as one value.
_METRIC_TABLES = (
    "badput_s",
    "eval_scores",
    "stage_progress",
    "post_training",
    "interruption_timings",
    "resizes",
)


def _get(d: dict[str, Any], key: str) -> str:
    return safe(d.get(key))


# --- runs ------------------------------------------------------------------------------


def _find(d: dict[str, Any], *names: str) -> object:
    for scope in (d, d.get("progress"), d.get("training"), d.get("metrics")):
        if isinstance(scope, dict):
            for n in names:
                if scope.get(n) is not None:
                    return scope[n]
    return None


def progress(run: dict[str, Any]) -> str:
    step = _find(run, "step", "last_step", "global_step")
    loss = _find(run, "loss", "last_loss")
    parts = []
    if step is not None:
        parts.append(f"step={safe(step)}")
    if isinstance(loss, int | float):
        parts.append(f"loss={loss:.4f}")
    return " ".join(parts)


def _eta(seconds: float) -> str:
    s = round(seconds)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s}s"
    )


def stage_progress(p: dict[str, Any]) -> str:
    """One line: stage step (i/n): tasks, documents, MB, ETA."""
    eta = p.get("eta_s")
    mb_done = (p.get("bytes_done") or 0) / 1e6
    mb_total = (p.get("bytes_total") or 0) / 1e6
    return (
        f"{_get(p, 'stage')} {_get(p, 'step')} ({int(p.get('step_index') or 0) + 1}/"
        f"{_get(p, 'steps')}): {_get(p, 'tasks_done')}/{_get(p, 'tasks_total')} tasks, "
        f"{_get(p, 'docs_done')}/{_get(p, 'docs_total')} documents, "
        f"{mb_done:.1f}/{mb_total:.1f} MB"
        + (f", eta {_eta(float(eta))}" if isinstance(eta, int | float) else "")
    )


def _bound(c: dict[str, Any]) -> str:
    parts = [
        f"{label} {human.score(c[k])}"
        for k, label in (("min", "min"), ("max", "max"), ("max_regression", "max regression"))
        if c.get(k) is not None
    ]
    if parts and c.get("max_regression") is not None and c.get("previous") is not None:
        parts[-1] += f" (previous {human.score(c['previous'])})"
    return ", ".join(parts) or "-"


def eval_gate(eg: dict[str, Any], indent: str = "  ") -> str:
    head = (
        f"{indent}eval gate {_get(eg, 'phase')} (battery {_get(eg, 'battery')}, step "
        f"{_get(eg, 'step')}): {'passed' if eg.get('passed') else 'FAILED'}"
    )
    return _with_checks(head, eg, indent)


# How a post-training objective's gate status reads in its header (else as sent).
_OBJECTIVE_VERDICT = {"failed": "FAILED", "not_run": "not run"}


def objective_gate(og: dict[str, Any], checks: dict[str, Any] | None, indent: str = "  ") -> str:
    """A post-training objective's gate as a phase's is shown: a header (its gate metric
    as measured and its bound, the battery it names, its steps, the verdict), then the
    checks it was decided on (``checks``: its ``eval_gates`` entry, once decided)."""
    gate = "no gate metric"
    if og.get("metric") is not None:
        measured = f" {human.score(og['value'])}" if og.get("value") is not None else ""
        gate = f"gate {_get(og, 'metric')}{measured}, min {human.score(og.get('min'))}"
    battery = f", battery {_get(og, 'battery')}" if og.get("battery") else ""
    status = str(og.get("status"))
    head = (
        f"{indent}objective gate {_get(og, 'objective')} ({gate}{battery}, step "
        f"{_get(og, 'steps')}): {safe(_OBJECTIVE_VERDICT.get(status, status))}"
    )
    return _with_checks(head, checks or {}, indent)


def _with_checks(head: str, eg: dict[str, Any], indent: str) -> str:
    rows = [
        (
            c.get("check"),
            human.score(c.get("score")),
            _bound(c),
            "ok" if c.get("passed") else "FAIL",
            c.get("reason") or "",
        )
        for c in eg.get("checks") or []
    ]
    if not rows:
        return head
    return head + "\n" + table(("check", "score", "bound", "result", "reason"), rows, indent + "  ")


def run(r: dict[str, Any]) -> str:
    lines = [
        f"run {_get(r, 'run_id')}  state={_get(r, 'state')}"
        + (f" ({safe(r['state_reason'])})" if r.get("state_reason") else ""),
        f"  booking={_get(r, 'booking_id')} manifest={_get(r, 'manifest_id')} "
        f"key={_get(r, 'idempotency_key')} cost estimate "
        f"{human.value('cost_estimate_usd', r.get('cost_estimate_usd'))}",
    ]
    prog = progress(r)
    if prog:
        lines.append(f"  {prog}")
    sp = r.get("stage_progress")
    if isinstance(sp, dict) and sp.get("step"):
        lines.append(f"  {stage_progress(sp)}")
    gates = r.get("stage_gates") or []
    if gates:
        lines.append(
            table(
                ("stage", "gate", "reason"),
                [(g.get("stage"), g.get("status"), g.get("reason") or "") for g in gates],
                "  ",
            )
        )
    objectives = r.get("post_training_gates") or []
    evals = {eg.get("phase"): eg for eg in r.get("eval_gates") or []}
    shown = {og.get("phase") for og in objectives}
    lines += [eval_gate(eg) for phase, eg in evals.items() if phase not in shown]
    lines += [objective_gate(og, evals.get(og.get("phase"))) for og in objectives]
    proposals = r.get("proposals") or []
    if proposals:
        lines.append(
            table(
                ("proposal", "status", "action", "description"),
                [
                    (p.get("proposal_id"), p.get("status"), p.get("action"), p.get("description"))
                    for p in proposals
                ],
                "  ",
            )
        )
    resizes = r.get("resizes") or []
    if resizes:
        lines.append(resize_table(resizes))
    if r.get("replayed"):
        lines.append("  (replayed: this idempotency key already named this run)")
    return "\n".join(lines)


def resize_table(resizes: list[dict[str, Any]], indent: str = "  ") -> str:
    """Each resize to the run's booking: when the booking changed, groups before and
    after, how it went, seconds from the change to the first step with the new count
    (a join or a leave), and why."""
    return table(
        ("resize at", "groups", "status", "took", "why"),
        [
            (
                x.get("requested_at"),
                f"{safe(x.get('groups_before'))} -> {safe(x.get('groups_after'))}",
                x.get("status"),
                _seconds(x.get("seconds")),
                (f"{x['code']}: " if x.get("code") else "") + str(x.get("reason") or ""),
            )
            for x in resizes
        ],
        indent,
    )


def log_entry(e: dict[str, Any]) -> str:
    ts = e.get("ts")
    when = time.strftime("%H:%M:%S", time.gmtime(ts)) if isinstance(ts, int | float) else safe(ts)
    return (
        f"{when} {safe(e.get('level', '')):<7} {safe(e.get('stage') or '-'):<14} "
        f"{safe(e.get('message', ''))}"
    )


# --- telemetry -------------------------------------------------------------------------


def metrics(d: dict[str, Any]) -> str:
    scalars = [(k, human.value(k, v)) for k, v in d.items() if k not in _METRIC_TABLES]
    parts = [table(("metric", "value"), scalars)]
    badput = d.get("badput_s") or {}
    if badput:
        parts.append(
            table(
                ("badput cause", "time"), [(k, human.duration(float(v))) for k, v in badput.items()]
            )
        )
    timings = d.get("interruption_timings") or []
    if timings:
        parts.append(
            table(
                ("interruption", "kind", "group", "detect", "recover"),
                [
                    (
                        t.get("index"),
                        t.get("kind"),
                        "-" if t.get("replica_group") is None else t.get("replica_group"),
                        _seconds(t.get("detect_s")),
                        _seconds(t.get("recover_s")),
                    )
                    for t in timings
                ],
            )
        )
    resizes = d.get("resizes") or []
    if resizes:
        parts.append(
            table(
                ("resize", "groups", "action", "step", "took"),
                [
                    (
                        x.get("request_id"),
                        f"{safe(x.get('groups_before'))} -> {safe(x.get('groups_after'))}",
                        x.get("action"),
                        "-" if x.get("step") is None else x.get("step"),
                        _seconds(x.get("seconds")),
                    )
                    for x in resizes
                ],
            )
        )
    scores = d.get("eval_scores") or []
    if scores:
        parts.append(
            table(
                ("phase", "check", "score", "result"),
                [
                    (
                        e.get("phase"),
                        e.get("check"),
                        human.score(e.get("score")),
                        "ok" if e.get("passed") else "FAIL",
                    )
                    for e in scores
                ],
            )
        )
    sp = d.get("stage_progress")
    if isinstance(sp, dict):
        eta = sp.get("eta_s")
        parts.append(
            table(
                ("stage", "step", "tasks", "documents", "bytes", "elapsed", "eta"),
                [
                    (
                        sp.get("stage"),
                        f"{safe(sp.get('step'))} ({int(sp.get('step_index') or 0) + 1}/"
                        f"{safe(sp.get('steps'))})",
                        f"{safe(sp.get('tasks_done'))}/{safe(sp.get('tasks_total'))}",
                        f"{human.value('docs', sp.get('docs_done'))}/"
                        f"{human.value('docs', sp.get('docs_total'))}",
                        f"{human.size(float(sp.get('bytes_done') or 0))}/"
                        f"{human.size(float(sp.get('bytes_total') or 0))}",
                        human.value("elapsed_s", sp.get("elapsed_s")),
                        human.duration(float(eta)) if isinstance(eta, int | float) else "-",
                    )
                ],
            )
        )
    post = d.get("post_training") or {}
    if post:
        parts.append(
            table(("post-training", "value"), [(k, human.value(k, v)) for k, v in post.items()])
        )
    return "\n\n".join(parts)


def _seconds(v: object) -> str:
    return human.duration(float(v)) if isinstance(v, int | float) else "-"


def checkpoints(d: dict[str, Any]) -> str:
    rows = [
        (
            c.get("step"),
            human.value("bytes", c.get("bytes")),
            human.value("blocking_s", c.get("blocking_s")),
            human.value("total_s", c.get("total_s")),
            human.value("bytes_per_s", c.get("bytes_per_s")),
            (
                f"{safe(c['phase'])}{' (closes it)' if c.get('closes_phase') else ''}"
                if c.get("phase")
                else "-"
            ),
            c.get("path"),
        )
        for c in d.get("checkpoints") or []
    ]
    if not rows:
        return "no checkpoints"
    return table(("step", "size", "blocking", "total", "bandwidth", "phase", "path"), rows)


# --- dispatch --------------------------------------------------------------------------


def readable(command: str, data: dict[str, Any]) -> str:
    """The readable form of a successful answer to ``command``."""
    if command == "plan":
        return plan_response(data)
    if command in ("train", "status", "cancel", "approve", "decline") and "run_id" in data:
        return run(data)
    if command == "logs":
        return "\n".join(log_entry(e) for e in data.get("entries") or [])
    if command == "find":
        return (
            "\n".join(run(r) for r in data.get("runs") or []) or "no run for this idempotency key"
        )
    if command == "confirm":
        return safe(data.get("confirmation_ref"))
    if command == "manifest":
        return manifest_init(data)
    if command == "checkpoints":
        return checkpoints(data)
    if command == "metrics":
        return metrics(data)
    if command == "cleanup":
        r = data.get("run") or {}
        return (
            f"run {_get(r, 'run_id')} state={_get(r, 'state')}: removed "
            f"{len(data.get('removed') or [])} paths, "
            f"{human.value('bytes_removed', data.get('bytes_removed'))}; "
            f"booking untouched={_get(data, 'booking_untouched')}"
        )
    return json.dumps(data, indent=2, sort_keys=True)
