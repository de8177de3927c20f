"""A rank's lifecycle table (``rank_state``): every listed move is taken, every other
refused, and a poll never sees half a move."""

from __future__ import annotations

import itertools
import pickle
import threading

import pytest

from stages.trainer.rank.rank_state import (
    ENDED_STATES,
    RANK_TRANSITIONS,
    IllegalTransition,
    RankPoll,
    RankState,
    RankStatus,
)


def _at(state: RankState) -> RankStatus:
    """A status walked to ``state`` along the table's first path there."""
    status = RankStatus(pid=1, gpu_ids=[], restarted=False, started_at=0.0)
    path = _path_to(state)
    for step in path[1:]:
        status.enter(step)
    assert status.state is state
    return status


def _path_to(target: RankState) -> list[RankState]:
    paths = {RankState.starting: [RankState.starting]}
    frontier = [RankState.starting]
    while frontier:
        here = frontier.pop(0)
        for there in sorted(RANK_TRANSITIONS[here]):
            if there not in paths:
                paths[there] = [*paths[here], there]
                frontier.append(there)
    paths.setdefault(RankState.error, [RankState.starting, RankState.error])
    return paths[target]


ALL_MOVES = list(itertools.product(RankState, RankState))


def test_every_state_is_reachable_and_has_a_row() -> None:
    assert set(RANK_TRANSITIONS) == set(RankState)
    for state in RankState:
        assert _path_to(state)[-1] is state
    # Ended states lead nowhere: a rank that ended starts over as a new process/loop.
    assert all(not RANK_TRANSITIONS[s] for s in ENDED_STATES)


@pytest.mark.parametrize(("src", "dst"), ALL_MOVES, ids=[f"{a}->{b}" for a, b in ALL_MOVES])
def test_each_move_is_taken_or_refused_as_the_table_says(src: RankState, dst: RankState) -> None:
    status = _at(src)
    allowed = dst is RankState.error or dst in RANK_TRANSITIONS[src]
    if allowed:
        status.enter(dst)
        assert status.report().state is dst
    else:
        with pytest.raises(IllegalTransition, match=f"from {src} to {dst}"):
            status.enter(dst)
        assert status.state is src  # a refused move changes nothing


def test_the_fields_of_a_move_change_with_it() -> None:
    status = _at(RankState.training)
    status.enter(RankState.paused, paused_at=7, digest="abc")
    report = status.report()
    assert (report.state, report.paused_at, report.digest) == (RankState.paused, 7, "abc")
    status.enter(RankState.training, paused_at=None, spike=None)
    assert status.report().paused_at is None


def test_update_changes_fields_never_the_state() -> None:
    status = _at(RankState.training)
    status.update(step=5, quorum=2)
    assert (status.report().step, status.report().quorum) == (5, 2)
    with pytest.raises(TypeError):
        status.update(state=RankState.finished)
    with pytest.raises(TypeError, match="stepp"):
        status.update(stepp=6)  # a misspelt field is refused, not carried
    with pytest.raises(TypeError, match="boundry"):
        status.enter(RankState.phase_end, boundry=1)
    assert status.state is RankState.training and status.report().step == 5
    with pytest.raises(ValueError):  # a report is frozen: no change behind the lock
        status.report().step = 9  # type: ignore[misc]


def test_a_report_crosses_the_process_boundary_whole() -> None:
    status = _at(RankState.phase_end)
    status.update(boundary=1, layout={"dp_shard": 2})
    poll = pickle.loads(pickle.dumps(RankPoll(events=[{"kind": "log"}], report=status.report())))
    assert poll.report == status.report() and poll.events == [{"kind": "log"}]


def test_a_poll_never_sees_half_a_move() -> None:
    """The loop's thread pauses and resumes while another thread reads reports: a
    paused report always carries its step, a training one never does."""
    status = _at(RankState.training)
    stop = threading.Event()
    torn: list[object] = []

    def read() -> None:
        while not stop.is_set():
            r = status.report()
            if (r.state is RankState.paused) != (r.paused_at is not None):
                torn.append(r)

    reader = threading.Thread(target=read)
    reader.start()
    for step in range(2000):
        status.enter(RankState.paused, paused_at=step)
        status.enter(RankState.training, paused_at=None)
    stop.set()
    reader.join()
    assert not torn
