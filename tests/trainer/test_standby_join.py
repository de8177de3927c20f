"""How a standby's activation is accounted: taking a lost group's place is a failure's
recovery (a ``recovery`` span until the full quorum), while a grow's promoted standby
(activated ``joining``) joins as a launched joiner does, its time the resize's. The
rank's loop runs for real; its start-up, sync and saver are fakes (no torch group)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.train_configs import two_group_tiny_config

from orchestrator.telemetry.goodput import compute_run_metrics
from stages.events import Event, PhaseEvent, ResizeEvent
from stages.run_secret import RunSecret
from stages.trainer.rank.control import Control, WorkerSpec
from stages.trainer.rank.loop import TrainLoop
from stages.trainer.rank.rank_state import RankState, RankStatus
from stages.trainer.rank.step_state import StepResult

FIRST_STEP = 3  # the run's step when the standby joins
STEPS = 2  # the steps it trains before it is stopped


class FakeSync:
    """Commits every step in the full quorum (3 groups: 2 planned and the new one),
    each ending a second after the last; stops the loop after ``STEPS`` steps."""

    mid_turn = False

    def __init__(self, loop: TrainLoop):
        self.loop = loop
        self.step = FIRST_STEP

    def join_running_run(self, *_: Any) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def train_step(self, loop: TrainLoop, step: int) -> StepResult:
        self.step = step + 1
        if self.step - FIRST_STEP >= STEPS:
            loop.control.send("stop")
        ended = loop.started_at + float(self.step - FIRST_STEP)
        return StepResult(step, True, 2.0, 1.0, 1e-3, step, 3, 1.0, ended)

    def close(self) -> None:
        pass


class FakeStartup:
    """A warm standby's start-up: waits for its activation, then joins with fakes."""

    device = torch.device("cpu")

    def __init__(self, loop: TrainLoop):
        self.loop = loop

    def prepare_standby(self) -> None:
        self.loop.status.enter(RankState.standby)

    def wait_as_spare(self) -> bool:
        group = self.loop.control.wait_activation()
        assert group is not None
        self.loop.spec.replica_group = group
        self.loop.started_at = 1000.0
        self.loop.status.update(group=group, restarted=True)
        return True

    def build(self) -> None:
        raise AssertionError("a standby is built before its activation")

    def join(self) -> bool:
        loop = self.loop
        loop.status.enter(RankState.awaiting_data)
        loop.sync = FakeSync(loop)  # type: ignore[assignment]
        loop.model = torch.nn.Linear(2, 2)
        loop.manager = _Quiet()
        loop.saver = _Quiet()  # type: ignore[assignment]
        loop.detector = _Quiet()  # type: ignore[assignment]
        loop.objective = object()  # type: ignore[assignment]
        return True

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Quiet:
    """Answers every call with None (the saver saves nothing, no loss spikes)."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *_a, **_k: None


def _activated(tmp: Path, *, joining: bool) -> list[Event]:
    """The events of a standby rank activated as group 2 (``joining``: by a grow)."""
    cfg = two_group_tiny_config(tmp)
    spec = WorkerSpec(
        run_id="standby-join",
        replica_group=-1,
        rank=0,
        config=cfg,
        lighthouse_addr="",
        checkpoint_dir=str(tmp / "ckpt"),
        standby_index=0,
    )
    events: list[Event] = []
    control = Control()
    loop = TrainLoop(
        spec,
        emit=events.append,
        control=control,
        status=RankStatus(pid=1, gpu_ids=[], restarted=False, started_at=0.0),
        secret=RunSecret.new(),
        startup=FakeStartup,
    )
    control.send("activate", group=2, joining=joining)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    runner.join(timeout=120)  # a generous bound: the fakes never block
    assert not runner.is_alive()
    assert loop.status.state is RankState.stopped
    return events


def _recovery_spans(events: list[Event]) -> list[tuple[float, float]]:
    return [(e.start, e.end) for e in events if isinstance(e, PhaseEvent) and e.phase == "recovery"]


def test_a_stand_in_recovers_until_its_first_step_in_the_full_quorum(tmp_path: Path) -> None:
    events = _activated(tmp_path, joining=False)
    assert _recovery_spans(events) == [(1000.0, 1001.0)]


def test_a_grow_s_promoted_standby_joins_with_no_recovery(tmp_path: Path) -> None:
    events = _activated(tmp_path, joining=True)
    assert _recovery_spans(events) == []
    # Goodput counts the join as the resize it is (the booking change 5 s before the
    # activation, applied at the new group's first step), none of it as recovery.
    applied = ResizeEvent(
        request_id="grow",
        action="applied",
        groups_before=2,
        groups_after=3,
        step=FIRST_STEP + 1,
        seconds=6.0,
        ts=1001.0,
    )
    rows = [e.model_dump(mode="json") for e in [*events, applied]]
    m = compute_run_metrics(rows, started_at=990.0, now=1002.0)
    assert m.badput_s["recovery"] == 0.0
    assert m.badput_s["resize"] == pytest.approx(6.0)
