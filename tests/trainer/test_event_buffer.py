"""The bounded event buffer between ranks, engine and driver: flooded, it aggregates
and never drops what goodput and recovery accounting are computed from."""

from __future__ import annotations

from orchestrator.telemetry.goodput import compute_run_metrics
from stages.event_buffer import FOLDED, EventBuffer, expand_steps
from stages.events import InterruptionEvent, LogEvent, PhaseEvent, StepEvent


def _step(step: int, group: int, share: tuple[int, int] | None = None) -> dict[str, object]:
    return StepEvent(
        step=step,
        replica_group=group,
        loss=1.0,
        tokens=256,
        seconds=0.5,
        committed=True,
        quorum_size=2,
        phase="pretrain",
        batch_share=share,
    ).model_dump(mode="json")


def test_a_flooded_buffer_stays_bounded_and_keeps_every_step_phase_and_interruption() -> None:
    buf = EventBuffer(max_events=100)
    plain: list[dict[str, object]] = []
    for s in range(1, 5001):
        for g in (0, 1):
            ev = _step(s, g)
            buf.append(ev)
            plain.append(ev)
        if s % 7 == 0:
            buf.append(LogEvent(message=f"line {s}").model_dump(mode="json"))
        if s == 2500:
            for ev in (
                PhaseEvent(phase="recovery", start=1.0, end=2.0).model_dump(mode="json"),
                InterruptionEvent(
                    interruption_kind="replica_group_lost",
                    replica_group=1,
                    detected_at=1.0,
                    recovered_at=2.0,
                    detail="x",
                ).model_dump(mode="json"),
            ):
                buf.append(ev)
                plain.append(ev)
        assert len(buf) <= 200  # bounded whatever the consumer does
    out = buf.drain()
    kinds = [e["kind"] for e in out]
    assert kinds.count("interruption") == 1 and kinds.count("phase") == 1
    steps = {
        (int(e["replica_group"]), int(one["step"]))
        for e in out
        if e["kind"] == "step"
        for one in expand_steps(e)
    }
    assert steps == {(g, s) for g in (0, 1) for s in range(1, 5001)}
    logs = [str(e["message"]) for e in out if e["kind"] == "log"]
    [summary] = [m for m in logs if m.endswith(FOLDED)]
    # Every log line is either still there or counted in the one summary line.
    assert int(summary.split()[0]) + len(logs) - 1 == 5000 // 7
    # Goodput over the aggregated stream equals goodput over every event.
    a = compute_run_metrics(out, started_at=0.0, now=10_000.0)
    b = compute_run_metrics(plain, started_at=0.0, now=10_000.0)
    assert (
        (a.steps_committed, a.tokens, a.interruptions)
        == (b.steps_committed, b.tokens, b.interruptions)
        == (5000, 5000 * 256, 1)
    )
    assert a.productive_s == b.productive_s


def test_steps_of_two_batch_shares_are_never_merged() -> None:
    # A resize re-cuts a group's share of the global batch with the same quorum (the
    # new group joins the quorum a step before it shares the batch): the token ledger
    # reads each step's share, so a merged event holds steps of one share only.
    buf = EventBuffer(max_events=4)
    for s in range(1, 41):
        buf.append(_step(s, 0, (0, 2) if s <= 20 else (0, 3)))
    shares = {
        int(one["step"]): tuple(one["batch_share"]) for e in buf.drain() for one in expand_steps(e)
    }
    assert shares == {s: (0, 2) if s <= 20 else (0, 3) for s in range(1, 41)}
