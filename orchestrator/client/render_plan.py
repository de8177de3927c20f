"""``ito``'s readable plan: the parallelism plan's layout table, how the replica
groups sync, the curriculum's phases, and the answers of ``ito plan`` and
``ito manifest init`` that show them. Every server value goes through ``human.safe``
as in ``render.py``."""

from __future__ import annotations

from typing import Any

from orchestrator.client import human
from orchestrator.client.human import safe, table

# Plan fields shown in the layout table, in this order, with their labels.
_LAYOUT = (
    ("tp", "tp"),
    ("pp", "pp"),
    ("cp", "cp"),
    ("dp_shard", "fsdp"),
    ("dp_replicate", "replicas"),
    ("micro_batch", "micro-batch"),
    ("grad_accum", "grad-accum"),
    ("activation_checkpointing", "recompute"),
    ("precision", "precision"),
)


def _get(d: dict[str, Any], key: str) -> str:
    return safe(d.get(key))


def plan_layout(plan: dict[str, Any] | None, refusal: object = None, indent: str = "  ") -> str:
    """The parallelism plan as a key/value table and the layouts it beat."""
    if not plan:
        why = ""
        if isinstance(refusal, dict):
            why = f" ({safe(refusal.get('code'))}: {safe(refusal.get('message'))})"
        return f"{indent}plan: none{why}"
    mem = plan.get("memory") or {}
    rows = [
        (
            "model",
            f"{_get(plan, 'model')} on {_get(plan, 'node_count')} node(s) x "
            f"{_get(plan, 'gpus_per_node')} {_get(plan, 'gpu_sku')} over "
            f"{_get(plan, 'fabric')} ({_get(plan, 'world_size')} ranks)",
        ),
        ("layout", "  ".join(f"{label} {safe(plan[k])}" for k, label in _LAYOUT if k in plan)),
        (
            "batch",
            f"{human.value('tokens', plan.get('global_batch_tokens'))} tokens of seq_len "
            f"{_get(plan, 'seq_len')}",
        ),
        (
            "memory",
            f"{plan.get('peak_memory_gib')} GiB peak of {mem.get('capacity', '?')} GiB per GPU",
        ),
        (
            "step time",
            f"{human.value('step_time_s', plan.get('step_time_s'))}, "
            f"{human.value('tokens_per_s', plan.get('tokens_per_s'))}, MFU "
            f"{human.value('ratio', plan.get('mfu'))}",
        ),
    ]
    held = plan.get("rollout_gpus_per_node")
    if held:
        rows.append(
            (
                "rollout",
                f"{safe(held)} GPU(s) a node for RLVR's rollout workers, beside the "
                f"trainer's {_get(plan, 'gpus_per_node')}",
            )
        )
    sync = _sync(plan)
    if sync:
        rows.append(("sync", sync))
    rows += [
        ("why" if i == 0 else "", reason) for i, reason in enumerate(plan.get("reasons") or [])
    ]
    lines = [f"{indent}plan:", human.pairs(rows, indent + "  ")]
    rejected = plan.get("rejected") or []
    if rejected:
        lines.append(
            table(
                ("rank", "other layout", "tokens/s", "mfu", "peak mem", "why not"),
                [
                    (
                        c.get("rank"),
                        c.get("layout"),
                        human.count_rate(float(c.get("tokens_per_s") or 0), ""),
                        human.value("ratio", c.get("mfu")),
                        f"{c.get('peak_memory_gib')} GiB",
                        c.get("reason") or "",
                    )
                    for c in rejected
                ],
                indent + "  ",
            )
        )
    return "\n".join(lines)


def _sync(plan: dict[str, Any]) -> str:
    """How the replica groups sync and each mode's predicted step ("" for a plan
    stored before the planner chose it)."""
    sync = plan.get("sync")
    if not isinstance(sync, dict):
        return ""
    if sync.get("mode") == "diloco":
        fragments = int(sync.get("fragments") or 1)
        text = (
            f"DiLoCo every {safe(sync.get('sync_every'))} steps"
            + (f" in {fragments} fragments" if fragments > 1 else "")
            + f" (outer Nesterov lr {safe(sync.get('outer_lr'))}, momentum "
            f"{safe(sync.get('outer_momentum'))})"
        )
    else:
        text = "every step"
    by_mode = plan.get("step_time_by_sync")
    if isinstance(by_mode, dict) and len(by_mode) > 1:
        text += "; predicted step " + ", ".join(
            f"{safe(k).replace('_', ' ')} {human.value('step_time_s', v)}"
            for k, v in by_mode.items()
        )
    return text


def _phase_gates(ph: dict[str, Any]) -> str:
    return (
        ", ".join(
            safe(g.get("metric"))
            + "".join(f" {k}={safe(g[k])}" for k in ("min", "max", "max_regression") if k in g)
            for g in ph.get("gates") or []
        )
        or "every check must run"
    )


def phases(validation: dict[str, Any], indent: str = "  ") -> str:
    cur = validation.get("curriculum") or {}
    rows = [
        (
            ph.get("name"),
            ph.get("kind"),
            "-".join(str(s) for s in ph.get("steps") or []),
            human.value("tokens", ph.get("token_budget")),
            ph.get("seq_len"),
            ph.get("battery"),
            _phase_gates(ph),
        )
        for ph in cur.get("phases") or []
    ]
    if not rows:
        return ""
    return table(("phase", "kind", "steps", "tokens", "seq len", "battery", "gates"), rows, indent)


def plan_response(d: dict[str, Any]) -> str:
    lines = [
        f"manifest {_get(d, 'manifest_id')} (sha256 {_get(d, 'manifest_digest')})",
        f"  booking {_get(d, 'booking_id')}: cost estimate "
        f"{human.value('cost_estimate_usd', d.get('cost_estimate_usd'))}"
        + (
            f", beyond the booking's term "
            f"{human.value('incremental_cost_usd', d['incremental_cost_usd'])}"
            if d.get("incremental_cost_usd") is not None
            else ""
        ),
    ]
    validation = d.get("validation") or {}
    rows = []
    for name, result in validation.items():
        if name == "curriculum":
            continue  # its own table below
        shown = (
            safe(result)
            if not isinstance(result, dict)
            else ", ".join(
                f"{safe(k)} {human.value(k, v)}"
                for k, v in result.items()
                if not isinstance(v, dict | list)
            )
        )
        if shown:
            rows.append((name, shown))
    if rows:
        lines.append(table(("check", "result"), rows, "  "))
    lines.append(plan_layout(d.get("plan"), d.get("plan_refusal")))
    table_of_phases = phases(validation)
    if table_of_phases:
        lines.append(table_of_phases)
    return "\n".join(lines)


def manifest_init(d: dict[str, Any]) -> str:
    lines = [
        f"wrote {_get(d, 'manifest_path')} (0600)",
        f"  sha256 {_get(d, 'manifest_digest')}  preset {_get(d, 'model_preset')}  "
        f"evals {', '.join(safe(s) for s in d.get('eval_suites') or [])}",
    ]
    if "cost_estimate_usd" in d:
        lines.append(
            f"  server cost estimate {human.value('cost', d['cost_estimate_usd'])}"
            f" (beyond the booking's term "
            f"{human.value('cost', d.get('incremental_cost_usd') or 0.0)})"
        )
        lines.append(plan_layout(d.get("plan"), d.get("plan_refusal")))
        table_of_phases = phases(d.get("validation") or {})
        if table_of_phases:
            lines.append(table_of_phases)
    lines += ["next:", *(f"  {safe(k)}: {safe(v)}" for k, v in (d.get("next") or {}).items())]
    return "\n".join(lines)
