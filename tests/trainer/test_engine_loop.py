"""Fast checks of the engine's pure pieces: LR schedule, step -> data batch mapping,
the fault-tolerance config's guards, the stage's data resolution, light imports, and
the gradient allreduce against a real single-replica torchft Manager."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.fresh_python import run_python
from pydantic import ValidationError

from stages.base import GateOutcome, StageContext
from stages.errors import ItoError
from stages.trainer.config import FaultToleranceConfig, TrainStageConfig
from stages.trainer.rank.rank_state import RankPoll, RankReport, RankState
from stages.trainer.rank.step_state import data_index
from stages.trainer.stage import resolve_train_files


def _cfg(**kw: object) -> TrainStageConfig:
    base: dict[str, object] = dict(
        model={"preset": "llama-tiny", "size": "0.1M"},
        target={"max_steps": 10, "seq_len": 32, "global_batch_tokens": 256},
        checkpoint={"interval_steps": 5, "storage_uri": "file:///tmp/x"},
    )
    base.update(kw)
    return TrainStageConfig.model_validate(base, strict=False)


def _engine(cfg: TrainStageConfig, run_id: str, fleet: object = None) -> Any:
    """An engine that never starts: its bookkeeping is driven by hand."""
    from stages.trainer.fleet.engine import TrainingEngine

    return TrainingEngine(
        cfg,
        run_id=run_id,
        checkpoint_dir=Path("/nonexistent"),
        role_shards={},
        emit=lambda e: None,
        cancel_event=threading.Event(),
        wait_decision=lambda pid, t: None,
        fleet=fleet,
    )


def test_a_run_without_a_curriculum_is_one_phase_warmup_then_cosine_to_the_floor() -> None:
    cfg = _cfg(
        target={
            "max_steps": 20,
            "seq_len": 32,
            "global_batch_tokens": 256,
            "learning_rate": 1.0,
            "warmup_steps": 4,
        }
    )
    [phase] = cfg.schedule.phases
    assert (phase.start_step, phase.end_step, phase.seq_len) == (0, 20, 32)
    assert phase.data_weights == {"baseline": 1.0, "custom": 1.0}
    assert phase.eval_battery is None
    lrs = [phase.lr(s) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    assert phase.lr(20) == pytest.approx(0.1)
    assert phase.lr(10_000) == pytest.approx(0.1)


def test_data_index_skips_windows_without_changing_earlier_steps() -> None:
    assert [data_index(s, []) for s in range(5)] == [0, 1, 2, 3, 4]
    windows = [(30, 35)]
    # Steps before the window keep their batches; from the window on, 5 are skipped.
    assert [data_index(s, windows) for s in (29, 30, 31)] == [29, 35, 36]
    # A later window stacks on the first one (it starts where the loop then was).
    two = [(30, 35), (45, 47)]
    assert data_index(39, two) == 44
    assert data_index(40, two) == 47


def test_quorum_timeout_must_exceed_heartbeat_timeout() -> None:
    with pytest.raises(ValidationError, match="quorum_timeout_s"):
        FaultToleranceConfig(heartbeat_timeout_ms=5000, quorum_timeout_s=2.0)
    with pytest.raises(ValidationError, match="heartbeat_interval_ms"):
        FaultToleranceConfig(heartbeat_timeout_ms=500, heartbeat_interval_ms=400)
    d = FaultToleranceConfig()
    # The defaults notice a dead group within 3 s (heartbeat timeout + a tick).
    assert d.heartbeat_timeout_ms + d.quorum_tick_ms < 3000
    assert d.quorum_timeout_s * 1000 > d.heartbeat_timeout_ms


def test_micro_batch_splits_the_global_batch_over_every_rank() -> None:
    assert _cfg(replica_groups=2).micro_batch == 4
    assert _cfg(replica_groups=4, ranks_per_group=2).micro_batch == 1


def test_train_files_come_from_config_or_data_prep(tmp_path: Path) -> None:
    ctx = StageContext(run_id="r", booking_id="b", workdir=tmp_path)
    with pytest.raises(ItoError) as e:
        resolve_train_files(_cfg(), ctx)
    assert e.value.code == "data_not_found"
    ctx.previous["data_prep"] = GateOutcome(
        stage="data_prep",
        status="passed",
        reason="ok",
        artifacts={"train_files": {"custom": ["/d/c.jsonl"], "baseline": ["/d/b.jsonl"]}},
    )
    assert resolve_train_files(_cfg(), ctx) == [Path("/d/b.jsonl"), Path("/d/c.jsonl")]
    own = _cfg(train_files=["file:///x/a.jsonl"])
    assert resolve_train_files(own, ctx) == [Path("/x/a.jsonl")]


def test_importing_stages_trainer_pulls_in_neither_ray_nor_torchft() -> None:
    code = (
        "import json, sys, stages.trainer as t; t.TrainStageConfig; "
        "print(json.dumps(any(m == 'ray' or m.startswith('torchft') for m in sys.modules)))"
    )
    assert run_python(code) is False


def test_the_lighthouse_actor_serves_without_importing_torch() -> None:
    """The lighthouse process loads torchft's Rust extension alone (torchft's package
    imports torch, seconds of CPU every trainer waits for); a later ``import torchft``
    in the same process reuses that module."""
    code = (
        "import sys, json\n"
        "from stages.trainer.config import FaultToleranceConfig\n"
        "from stages.trainer.fleet.lighthouse import LighthouseActor\n"
        "lh = LighthouseActor(FaultToleranceConfig())\n"
        "addr = lh.address()\n"
        "torch_before = 'torch' in sys.modules\n"
        "import torchft._torchft, torchft.coordination\n"
        "same = torchft.coordination.LighthouseServer is type(lh.server)\n"
        "lh.shutdown()\n"
        "print(json.dumps([addr, torch_before, same]))\n"
    )
    addr, torch_before, same = run_python(code)
    assert addr.startswith("http://") and int(addr.rsplit(":", 1)[1]) > 0
    assert torch_before is False
    assert same is True


def test_allreduce_gradients_with_a_real_manager_keeps_a_lone_replica_exact() -> None:
    """One replica group against a real lighthouse: the averaged gradient of a
    quorum of one is the gradient itself, bucket boundaries included, and the loss
    carried in the last bucket comes back whole."""
    from helpers.ft_manager import one_rank_manager

    from stages.run_secret import RunSecret
    from stages.trainer.fleet.lighthouse import start_lighthouse
    from stages.trainer.rank import ft

    cfg = FaultToleranceConfig()
    lighthouse = start_lighthouse(cfg)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    manager, _store = one_rank_manager(cfg, lighthouse.address(), secret=RunSecret.new())
    try:
        model(torch.randn(4, 8)).sum().backward()
        before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        manager.start_quorum()
        loss = torch.tensor(2.5)
        reducer = ft.GradientReducer(manager, model.parameters(), bucket_bytes=64)
        assert len(reducer.buckets) > 1
        mean = reducer.finish(loss).loss
        after = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert mean == 2.5  # the loss rode in the last bucket
        assert manager.should_commit()
        assert manager.current_step() == 1
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def test_the_engine_ends_once_every_ranks_final_digest_came_or_the_stop_timeout_passed() -> None:
    """Rank 0 of each group reports ``finished`` first; a TP peer's final shard digest
    comes on its own later reply, and the run's ``rank_digests`` must hold it."""

    engine = _engine(
        _cfg(replica_groups=2, ranks_per_group=2, fault_tolerance={"stop_timeout_s": 60.0}),
        "digests",
    )
    keys = [(g, r) for g in range(2) for r in range(2)]
    engine.actors = dict.fromkeys(keys)  # only their keys are read here

    def finished(key: tuple[int, int]) -> None:
        report = RankReport(
            pid=100 + 2 * key[0] + key[1], state=RankState.finished, step=8, digest=f"d{key}"
        )
        engine._on_reply(key, RankPoll(events=[], report=report), 0.0)

    for key in [(0, 0), (1, 0), (1, 1)]:
        finished(key)
    # Every group's rank 0 is done, rank 1 of group 0 not yet: neither exit may fire.
    assert not engine.supervisor.every_rank_finished(set(engine.actors))
    assert not engine.supervisor.stragglers_done()
    finished((0, 1))
    assert engine.supervisor.every_rank_finished(set(engine.actors))
    assert set(engine.rank_digests) == {"0/0", "0/1", "1/0", "1/1"}

    # A rank that died after its last step does not hold the run past the stop timeout.
    del engine.supervisor.reports[(0, 1)]  # its finished answer never came
    assert engine.supervisor._groups_finished_at is not None
    engine.supervisor._groups_finished_at -= 61.0
    assert engine.supervisor.every_rank_finished(set(engine.actors))


def test_a_fleet_a_standby_took_over_is_not_handed_on(tmp_path: Path) -> None:
    """A standby promoted into a group would, restarted by Ray, come back as the
    standby it was made as (its own assignment file): the run's ranks are then not
    left to the next run, which makes its own."""
    from stages.trainer.fleet.handoff import Fleet

    class Actor:
        """Stands in for a Ray actor handle: records the commands it is sent."""

        def __init__(self) -> None:
            self.sent: list[str] = []
            self.command = self

        def remote(self, what: str, *args: object) -> None:
            self.sent.append(what)

    engine = _engine(_cfg(replica_groups=2, spare_groups=1), "standby", Fleet(tmp_path / "fleet"))
    engine.actors = {(0, 0): Actor(), (1, 0): Actor()}
    assert engine._fleet_can_carry
    spare = Actor()
    engine.standby.groups = {0: ["spare0"]}
    engine.standby.ready = {"spare0"}
    engine.standby.spares = {"spare0": spare}
    engine.standby.start_one = lambda: None  # type: ignore[method-assign]  # no Ray here
    assert engine._promote_spare((1, 0))
    assert engine.actors[(1, 0)] is spare and spare.sent == ["activate"]
    assert not engine._fleet_can_carry
