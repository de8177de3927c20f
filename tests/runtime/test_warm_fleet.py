"""The trainer fleet is placed and warmed up while data prep runs, and a run whose data
gate fails tears that warm fleet down. A real RunDriver body on a real local Ray with
the real training stage; the planner and data prep are stand-in stages (what they
decide is not under test here: only when the fleet starts and stops around them)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest
from helpers.launch_specs import signed_spec
from helpers.waiting import wait_until
from pydantic import BaseModel

from orchestrator.runtime import launch
from orchestrator.runtime.driver import RunDriverImpl
from orchestrator.runtime.factories import StageFactory, StartEarly
from stages.base import GateOutcome, StageContext
from stages.errors import ErrorCode
from stages.trainer.config import ModelSpec, TrainingTarget, TrainStageConfig

WAIT_S = 240.0
# A wait for the warm fleet, then the driver's join (WAIT_S + 60): past pytest's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
GROUPS = 2


class _Cfg(BaseModel):
    pass


class _PlanStage:
    name: ClassVar[str] = "parallelism"
    config_model: ClassVar[type[BaseModel]] = _Cfg

    def __init__(self) -> None:
        self.config = _Cfg()

    def run(self, ctx: StageContext) -> GateOutcome:
        return GateOutcome(stage=self.name, status="passed", reason="planned")


class _FailingDataStage:
    """Data prep whose gate fails, after it has seen every trainer rank of the run
    warm (model built, group joined) and waiting for the data it will never get."""

    name: ClassVar[str] = "data_prep"
    config_model: ClassVar[type[BaseModel]] = _Cfg
    seen: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.config = _Cfg()

    def run(self, ctx: StageContext) -> GateOutcome:
        import ray

        from stages.trainer.rank.replica import worker_name

        names = [worker_name(ctx.run_id, g, 0) for g in range(GROUPS)]
        deadline = time.monotonic() + WAIT_S
        states: dict[str, Any] = {}
        while time.monotonic() < deadline and not ctx.cancelled:
            for n in names:
                try:
                    ref: Any = ray.get_actor(n).progress.remote()
                    states[n] = ray.get(ref, timeout=10).state
                except Exception:  # not placed yet, or still importing
                    states[n] = None
            if all(p == "awaiting_data" for p in states.values()):
                break
            time.sleep(0.5)
        type(self).seen[ctx.run_id] = dict(states)
        return GateOutcome(
            stage=self.name,
            status="failed",
            reason="every document was a near duplicate",
            error_code=ErrorCode.data_empty.value,
        )


@pytest.fixture(autouse=True)
def _launch_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "launch.key"
    monkeypatch.setenv(launch.LAUNCH_KEY_ENV, str(key))
    launch.ensure_launch_key(key)


def _train_config(tmp: Path) -> TrainStageConfig:
    return TrainStageConfig.model_validate(
        dict(
            model=ModelSpec(preset="llama-tiny", size="0.1M"),
            target=TrainingTarget(max_steps=4, seq_len=32, global_batch_tokens=256, warmup_steps=1),
            checkpoint={"interval_steps": 2, "storage_uri": f"file://{tmp}/ckpt"},
            train_files=[str(tmp / "never-read.jsonl")],
            replica_groups=GROUPS,
            spare_groups=0,
        ),
        strict=False,
    )


def _run_actors(run_id: str) -> list[str]:
    import ray

    return [
        str(n)
        for n in ray.util.list_named_actors()
        if isinstance(n, str) and n.startswith(f"run-{run_id}-")
    ]


def test_a_failed_data_gate_tears_down_the_fleet_that_warmed_during_data_prep(
    ray_local: None, tmp_path: Path
) -> None:
    from stages.trainer import TrainingStage

    run_id = f"warm{uuid.uuid4().hex[:8]}"
    cfg = _train_config(tmp_path)
    spec = signed_spec(tmp_path, run_id)
    pipeline: list[tuple[str, StageFactory]] = [
        ("parallelism", lambda ctx: _PlanStage()),
        ("data_prep", lambda ctx: _FailingDataStage()),
        ("train", StartEarly(lambda ctx: TrainingStage(cfg), after="parallelism")),
    ]
    driver = RunDriverImpl(
        spec.model_dump(), use_ray_metrics=False, pipeline=lambda _spec: pipeline
    )
    driver.start()
    assert driver._thread is not None
    driver._thread.join(timeout=WAIT_S + 60)
    assert driver.state == "failed"
    assert driver.error_code == ErrorCode.data_empty.value
    # While data prep ran, every rank had built its model and joined its group.
    assert set(_FailingDataStage.seen[run_id].values()) == {"awaiting_data"}
    events = driver.poll(-1)["events"]
    assert not [e for e in events if e.get("kind") == "stage_result" and e["stage"] == "train"]
    # The warm fleet (lighthouse and every rank) is gone.
    wait_until(lambda: _run_actors(run_id) == [], WAIT_S, "the warm fleet gone")
