"""What the trainer answers a resize request before any rank moves: the requests it
refuses (and why), and one that asks for the size the run already has. The engine is
built but never started: these answers are decided from its config and groups alone
(the moves themselves run on real Ray in test_elastic.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from stages.events import Event, ResizeEvent
from stages.resize import ResizeInbox, ResizeRequest
from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet.engine import TrainingEngine
from stages.trainer.fleet.resize import ResizeStage


def _engine(tmp: Path, **over: Any) -> tuple[TrainingEngine, ResizeInbox, list[Event]]:
    # 12 sequences a step over 2 groups: 1, 2, 3, 4, 6 and 12 groups split it evenly.
    cfg = TrainStageConfig.model_validate(
        dict(
            model={"preset": "llama-tiny", "size": "0.1M"},
            target={"max_steps": 10, "seq_len": 32, "global_batch_tokens": 384},
            checkpoint={"interval_steps": 5, "storage_uri": f"file://{tmp}/ckpt"},
            replica_groups=2,
            **over,
        ),
        strict=False,
    )
    inbox, events = ResizeInbox(), []
    engine = TrainingEngine(
        cfg,
        run_id="resize-answers",
        checkpoint_dir=tmp / "ckpt",
        role_shards=None,
        emit=events.append,
        cancel_event=threading.Event(),
        wait_decision=lambda _p, _t: None,
        resize_inbox=inbox,
    )
    return engine, inbox, events


def _answer(engine: TrainingEngine, inbox: ResizeInbox, events: list[Event], groups: int) -> Any:
    inbox.put(ResizeRequest(request_id=f"to-{groups}", replica_groups=groups, requested_at=0.0))
    engine.resizer.advance()
    (answer,) = [e for e in events if isinstance(e, ResizeEvent)]
    events.clear()
    return answer


def test_a_batch_that_does_not_split_over_the_new_groups_is_refused(tmp_path: Path) -> None:
    engine, inbox, events = _engine(tmp_path)
    answer = _answer(engine, inbox, events, 5)
    assert (answer.action, answer.groups_before, answer.groups_after) == ("refused", 2, 2)
    assert "does not split over 5" in answer.reason
    assert engine.resizer.stage is ResizeStage.idle and not engine.resizer.joining  # none made


def test_the_size_the_run_has_is_applied_at_once_and_nothing_moves(tmp_path: Path) -> None:
    engine, inbox, events = _engine(tmp_path)
    answer = _answer(engine, inbox, events, 2)
    assert (answer.action, answer.groups_after, answer.seconds) == ("applied", 2, 0.0)
    assert engine.resizer.stage is ResizeStage.idle


def test_a_lost_group_or_a_post_training_objective_keeps_its_groups(tmp_path: Path) -> None:
    engine, inbox, events = _engine(tmp_path)
    engine.groups[1].lost_at = time.time()  # lost, not yet healed
    answer = _answer(engine, inbox, events, 3)
    assert answer.action == "refused" and "lost" in answer.reason
    sft, inbox, events = _engine(
        tmp_path,
        objective={
            "kind": "sft",
            "data_path": str(tmp_path / "rows.jsonl"),
            "batch_size": 12,
            "builder": "stages.post_training.objectives:build_objective",
        },
    )
    answer = _answer(sft, inbox, events, 3)
    assert answer.action == "refused" and "sft" in answer.reason


def test_the_newest_request_replaces_one_not_yet_taken() -> None:
    inbox = ResizeInbox()
    for groups in (3, 4):
        inbox.put(ResizeRequest(request_id=f"r{groups}", replica_groups=groups, requested_at=0))
    taken = inbox.take()
    assert taken is not None and taken.request_id == "r4" and inbox.take() is None
