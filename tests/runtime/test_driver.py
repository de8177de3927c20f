"""The RunDriver body without Ray: tickets, numbered events, acks, gates, cancel."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from helpers.launch_specs import signed_spec
from helpers.waiting import wait_until
from pydantic import BaseModel

from orchestrator.runtime import launch
from orchestrator.runtime.driver import RunDriverImpl
from orchestrator.runtime.factories import StageFactory, StartEarly
from orchestrator.runtime.launch import LaunchSpec
from stages.base import GateOutcome, StageContext
from stages.errors import ErrorCode, ItoError
from stages.events import StepEvent


class _Cfg(BaseModel):
    pass


class _CountingStage:
    """A real stage implementation of the protocol, used to exercise the driver."""

    name: ClassVar[str] = "count"
    config_model: ClassVar[type[BaseModel]] = _Cfg

    def __init__(self, steps: int, *, status: str = "passed", block: threading.Event | None = None):
        self.config = _Cfg()
        self.steps, self.status, self.block = steps, status, block

    def run(self, ctx: StageContext) -> GateOutcome:
        for i in range(self.steps):
            ctx.emit(StepEvent(step=i + 1, loss=1.0, tokens=10, seconds=0.01, committed=True))
        if self.block is not None:
            while not ctx.cancelled:
                time.sleep(0.01)
        return GateOutcome(
            stage=self.name,
            status=self.status,  # type: ignore[arg-type]
            reason="test",
        )


# A hang guard for the driver thread's progress, never a speed claim.
WAIT_S = 60.0


@pytest.fixture(autouse=True)
def _launch_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    key = tmp_path / "launch.key"
    monkeypatch.setenv(launch.LAUNCH_KEY_ENV, str(key))
    launch.ensure_launch_key(key)
    return key


def _wait_state(d: RunDriverImpl, *states: str) -> None:
    wait_until(lambda: d.state in states, WAIT_S, f"the driver in {states} (it is {d.state})")


def test_unsigned_or_tampered_launch_refuses_to_run(tmp_path: Path) -> None:
    spec = signed_spec(tmp_path)
    with pytest.raises(ItoError) as e:
        RunDriverImpl(spec.model_copy(update={"ticket": ""}).model_dump(), use_ray_metrics=False)
    assert e.value.code == ErrorCode.driver_not_authorized
    tampered = spec.model_copy(update={"manifest_json": '{"evil": 1}'})
    with pytest.raises(ItoError):
        RunDriverImpl(tampered.model_dump(), use_ray_metrics=False)


def test_events_are_numbered_and_dropped_only_when_acknowledged(tmp_path: Path) -> None:
    spec = signed_spec(tmp_path, seq_start=41)
    d = RunDriverImpl(
        spec.model_dump(),
        use_ray_metrics=False,
        pipeline=lambda s: [("count", lambda ctx: _CountingStage(5))],
    )
    d.start()
    _wait_state(d, "succeeded")
    first = d.poll(after_seq=0)
    seqs = [e["seq"] for e in first["events"]]
    assert seqs == list(range(41, 41 + len(seqs)))
    assert any(e["kind"] == "stage_result" for e in first["events"])
    # Not acknowledged: the same events come again.
    assert [e["seq"] for e in d.poll(after_seq=0)["events"]] == seqs
    rest = d.poll(after_seq=seqs[2])["events"]
    assert [e["seq"] for e in rest] == seqs[3:]


def test_failed_gate_stops_the_pipeline(tmp_path: Path) -> None:
    ran: list[str] = []

    def pipeline(_s: LaunchSpec) -> list:
        def make(name: str, status: str):  # type: ignore[no-untyped-def]
            def f(ctx: StageContext) -> _CountingStage:
                ran.append(name)
                return _CountingStage(1, status=status)

            return f

        return [("a", make("a", "failed")), ("b", make("b", "passed"))]

    d = RunDriverImpl(signed_spec(tmp_path).model_dump(), use_ray_metrics=False, pipeline=pipeline)
    d.start()
    _wait_state(d, "failed")
    assert ran == ["a"]
    assert d.error_code == ErrorCode.gate_failed


def test_cancel_stops_a_running_stage_and_completed_stages_are_skipped(tmp_path: Path) -> None:
    done = GateOutcome(stage="a", status="passed", reason="earlier").model_dump()
    made: list[str] = []

    def pipeline(_s: LaunchSpec) -> list:
        def make_a(ctx: StageContext) -> _CountingStage:
            made.append("a")
            return _CountingStage(1)

        def make_b(ctx: StageContext) -> _CountingStage:
            made.append("b")
            return _CountingStage(1, block=threading.Event())

        return [("a", make_a), ("b", make_b)]

    d = RunDriverImpl(
        signed_spec(tmp_path, completed_stages={"a": done}, attempt=2).model_dump(),
        use_ray_metrics=False,
        pipeline=pipeline,
    )
    d.start()
    wait_until(lambda: "b" in made, WAIT_S, "stage b made")
    d.cancel()
    _wait_state(d, "cancelled")
    assert made == ["b"]


class _PrestartableStage(_CountingStage):
    """Records when the driver prestarts, runs and abandons it."""

    def __init__(self, calls: list[str]):
        super().__init__(1)
        self.calls = calls

    def prestart(self, ctx: StageContext) -> None:
        self.calls.append(f"prestart after {sorted(ctx.previous)}")

    def abandon(self) -> None:
        self.calls.append("abandon")

    def run(self, ctx: StageContext) -> GateOutcome:
        self.calls.append("run")
        return super().run(ctx)


@pytest.mark.parametrize("data_status", ["passed", "failed"])
def test_a_stage_started_early_is_prestarted_after_its_dependency_and_abandoned_unrun(
    tmp_path: Path, data_status: str
) -> None:
    calls: list[str] = []
    pipeline: list[tuple[str, StageFactory]] = [
        ("plan", lambda ctx: _CountingStage(0)),
        ("data", lambda ctx: _CountingStage(0, status=data_status)),
        ("train", StartEarly(lambda ctx: _PrestartableStage(calls), after="plan")),
    ]
    d = RunDriverImpl(
        signed_spec(tmp_path).model_dump(), use_ray_metrics=False, pipeline=lambda _s: pipeline
    )
    d.start()
    _wait_state(d, "succeeded", "failed")
    # Prestarted once the plan passed, before data ran; the same stage object runs.
    first = ["prestart after ['plan']"]
    assert calls == ([*first, "run"] if data_status == "passed" else [*first, "abandon"])


def test_operator_overrides_are_a_closed_set() -> None:
    from pydantic import ValidationError

    from orchestrator.runtime.supervisor_settings import SupervisorSettings

    assert SupervisorSettings(train_overrides={"pace_step_s": 0.1}).train_overrides
    with pytest.raises(ValidationError):
        SupervisorSettings(train_overrides={"replica_groups": 64})


def test_a_process_without_a_server_gets_a_private_throwaway_launch_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(launch.LAUNCH_KEY_ENV, raising=False)
    key = launch.use_scratch_launch_key(tmp_path)
    assert key == tmp_path / "launch.key"
    assert os.environ[launch.LAUNCH_KEY_ENV] == str(key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text()) == 64
    # A key the environment names is the one used; nothing new is made.
    other = tmp_path / "other"
    other.mkdir()
    assert launch.use_scratch_launch_key(other) == key
    assert not (other / "launch.key").exists()
