"""The engine asks each rank for its events at most once per ``poll_interval_s``,
however fast the rank answers: a poll answered at once must not be re-sent at once
(each poll costs the rank's training loop the GIL for the call). Between polls it
waits, also while a standby's poll goes unanswered (it is warming up): the driver
must not spin beside the ranks. A rank saving a phase's closing checkpoint is polled
sooner (the whole fleet waits for its boundary), within a bounded rate.

Real Ray actors stand in for the ranks: they answer every poll at once and count them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet.engine import TrainingEngine
from stages.trainer.rank.rank_state import RankPoll, RankReport, RankState

POLL_INTERVAL_S = 0.05
POLL_CALLS = 40
PASS_WINDOW_S = 1.0


def _cfg(tmp: Path, poll_interval_s: float = POLL_INTERVAL_S) -> TrainStageConfig:
    return TrainStageConfig.model_validate(
        dict(
            model={"preset": "llama-tiny", "size": "0.1M"},
            target={"max_steps": 10, "seq_len": 32, "global_batch_tokens": 256},
            checkpoint={"interval_steps": 5, "storage_uri": f"file://{tmp}/ckpt"},
            replica_groups=2,
            fault_tolerance={"poll_interval_s": poll_interval_s},
        ),
        strict=False,
    )


def _rank_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, pid: int, answer_after_s: float = 0.0) -> None:
            self.pid, self.polls, self.answer_after_s = pid, 0, answer_after_s

        def poll(self) -> RankPoll:
            self.polls += 1
            time.sleep(self.answer_after_s)
            return RankPoll(events=[], report=RankReport(pid=self.pid, state=RankState.training))

        def count(self) -> int:
            return self.polls

    return Rank


def _engine(tmp_path: Path, poll_interval_s: float = POLL_INTERVAL_S) -> TrainingEngine:
    return TrainingEngine(
        _cfg(tmp_path, poll_interval_s),
        run_id="pollpace",
        checkpoint_dir=tmp_path / "ckpt",
        role_shards=None,
        emit=lambda _e: None,
        cancel_event=threading.Event(),
        wait_decision=lambda _p, _t: None,
    )


def test_each_rank_is_polled_at_most_once_per_poll_interval(
    ray_local: None, tmp_path: Path
) -> None:
    import ray

    engine = _engine(tmp_path)
    ranks = [_rank_class().remote(1000 + g) for g in range(2)]
    engine.actors = {(g, 0): r for g, r in enumerate(ranks)}
    started = time.monotonic()
    for _ in range(POLL_CALLS):
        engine.poll_once(POLL_INTERVAL_S)
    elapsed = time.monotonic() - started
    counts = ray.get([r.count.remote() for r in ranks])
    # A rate bound, not a speed claim: a slower host only makes it easier to meet.
    bound = elapsed / POLL_INTERVAL_S + 1
    assert all(1 <= c <= bound for c in counts), (counts, bound)
    for r in ranks:
        ray.kill(r)


def test_a_standby_that_does_not_answer_yet_makes_no_busy_loop(
    ray_local: None, tmp_path: Path
) -> None:
    """Two ranks answer at once; a warming standby's poll stays unanswered. Each pass
    either waits for the ranks' polls or sleeps until their next turn: about two
    passes per interval, never a spin."""
    import ray

    engine = _engine(tmp_path)
    rank = _rank_class()
    engine.actors = {(g, 0): rank.remote(1000 + g) for g in range(2)}
    standby = rank.remote(2000, answer_after_s=60.0)
    engine.standby.spares = {"spare0": standby}
    passes, started = 0, time.monotonic()
    while (elapsed := time.monotonic() - started) < PASS_WINDOW_S:
        engine.poll_once(POLL_INTERVAL_S)
        passes += 1
    assert engine.standby.pending, "the standby's poll is still in flight"
    # A rate bound, not a speed claim: a slower host only makes it easier to meet.
    bound = 2 * (elapsed / POLL_INTERVAL_S + 1)
    assert passes <= bound, (passes, bound)
    for actor in [*engine.actors.values(), standby]:
        ray.kill(actor)


def _reply(step: int, boundary: int | None = None) -> RankPoll:
    state = RankState.training if boundary is None else RankState.phase_end
    report = RankReport(pid=1000, state=state, step=step, boundary=boundary)
    return RankPoll(events=[], report=report)


def test_a_rank_saving_a_phase_closing_checkpoint_is_polled_sooner(tmp_path: Path) -> None:
    """The run's one phase ends at step 10. A rank that committed step 10 and has not
    reported the boundary yet (its closing save is in flight) is next polled within
    ranks / phase_end_polls_per_s; a rank mid-phase, at the boundary already, or past
    a passed gate waits its regular interval."""
    interval = 5.0
    engine = _engine(tmp_path, poll_interval_s=interval)
    keys = [(g, 0) for g in range(2)]
    engine.actors = dict.fromkeys(keys)
    soon = len(keys) / engine.ft.phase_end_polls_per_s
    assert soon < interval

    def next_poll_in(reply: RankPoll, key: tuple[int, int] = keys[0]) -> float:
        now = time.monotonic()
        engine.polls.due_at.pop(key, None)
        assert engine.polls.due(key, now)  # polled now: the next is due a regular interval on
        engine._on_reply(key, reply, time.time())
        return engine.polls.due_at[key] - time.monotonic()

    assert next_poll_in(_reply(9)) > interval - 1
    assert next_poll_in(_reply(10)) <= soon
    assert next_poll_in(_reply(10, boundary=0)) > interval - 1
    engine.phase_ends.passed.add(0)
    assert next_poll_in(_reply(10)) > interval - 1
