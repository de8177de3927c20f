"""A run's metrics computed from its stored events (the runtime may supply richer ones).

goodput = committed productive step seconds / elapsed wall-clock of the run so far.
"""

from __future__ import annotations

from typing import Any

from orchestrator.store import Store


def run_metrics(store: Store, run_id: str) -> dict[str, Any]:
    events = store.list_events(run_id, kinds=["step", "phase", "interruption", "checkpoint"],
                               limit=1_000_000)
    steps = [e["payload"] for e in events if e["kind"] == "step"]
    phases = [e["payload"] for e in events if e["kind"] == "phase"]
    interruptions = [e["payload"] for e in events if e["kind"] == "interruption"]
    ckpts = [e["payload"] for e in events if e["kind"] == "checkpoint"]
    ts = [e["ts"] for e in events]
    elapsed = (max(ts) - min(ts)) if len(ts) > 1 else 0.0
    productive = sum(s["seconds"] for s in steps if s["committed"])
    badput: dict[str, float] = {}
    for ph in phases:
        badput[ph["phase"]] = badput.get(ph["phase"], 0.0) + max(0.0, ph["end"] - ph["start"])
    ck_bytes = sum(c["bytes"] for c in ckpts)
    ck_time = sum(c["total_s"] for c in ckpts)
    tokens = sum(s["tokens"] for s in steps if s["committed"])
    step_time = sum(s["seconds"] for s in steps)
    return {
        "goodput": productive / elapsed if elapsed > 0 else None,
        "badput": badput,
        "elapsed_s": elapsed,
        "productive_s": productive,
        "steps": len(steps),
        "committed_steps": sum(1 for s in steps if s["committed"]),
        "interruptions": len(interruptions),
        "interruption_rate_per_h": len(interruptions) / (elapsed / 3600) if elapsed > 0 else None,
        "checkpoint_bytes_per_s": ck_bytes / ck_time if ck_time > 0 else None,
        "tokens_per_s": tokens / step_time if step_time > 0 else None,
        "last_step": steps[-1]["step"] if steps else None,
        "last_loss": steps[-1]["loss"] if steps else None,
    }
