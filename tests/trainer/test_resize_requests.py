"""What the trainer answers a resize request before any rank moves: the requests it
refuses (and why), and one that asks for the size the run already has. The engine is
built but never started: these answers are decided from its config and groups alone
(the moves themselves run on real Ray in test_elastic.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from helpers.train_configs import two_group_tiny_config

from stages.curriculum.config import CurriculumConfig
from stages.curriculum.schedule import schedule_curriculum
from stages.events import Event, FleetEvent, ResizeEvent, StepEvent
from stages.resize import ResizeInbox, ResizeRequest, groups_off_booking
from stages.run_facts import PlacementFact
from stages.trainer.fleet.engine import TrainingEngine
from stages.trainer.fleet.resize import ResizeStage
from stages.trainer.rank.rank_state import RankReport, RankState


def _engine(tmp: Path, **over: Any) -> tuple[TrainingEngine, ResizeInbox, list[Event]]:
    # 12 sequences a step over 2 groups: 1, 2, 3, 4, 6 and 12 groups split it evenly.
    cfg = two_group_tiny_config(tmp, **over)
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


def test_every_phase_s_batch_must_split_over_the_new_groups(tmp_path: Path) -> None:
    """12 sequences of 32 tokens a step in pretraining, 6 of 64 in the long phase: 4
    groups split the first, not the second, so the run keeps its 2."""
    phases = CurriculumConfig.model_validate(
        {
            "phases": [
                {"name": "pretrain", "kind": "pretrain", "token_fraction": 0.5, "seq_len": 32},
                {"name": "long", "kind": "long_context", "token_fraction": 0.5, "seq_len": 64},
            ]
        },
        strict=False,
    )
    schedule = schedule_curriculum(
        phases,
        total_steps=10,
        base_seq_len=32,
        global_batch_tokens=384,
        learning_rate=1e-3,
        warmup_steps=2,
        rope_theta=10000.0,
        head_dim=16,
        max_positions=256,
    )
    engine, inbox, events = _engine(tmp_path, curriculum=schedule)
    answer = _answer(engine, inbox, events, 4)
    assert answer.action == "refused" and "phase long's global batch of 6" in answer.reason
    three = ResizeRequest(request_id="to-3", replica_groups=3, requested_at=0.0)
    assert engine.resizer.refusal(three) == ""  # 12 and 6 split 3 ways


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


def test_the_groups_off_the_booking_are_those_with_a_rank_on_a_node_it_lost() -> None:
    ranks = {(0, 0): "n0", (0, 1): "n0", (1, 0): "n1", (1, 1): "n2", (2, 0): "n2"}
    assert groups_off_booking(ranks, {"n1", "n2"}) == (0,)
    # A group with one rank on a node taken back leaves whole.
    assert groups_off_booking(ranks, {"n0", "n1"}) == (1, 2)
    assert groups_off_booking(ranks, {"n0", "n1", "n2"}) == ()
    # Not known: the booking's nodes, or a rank's (a stage run outside Ray).
    assert groups_off_booking(ranks, set()) == ()
    assert groups_off_booking({**ranks, (3, 0): ""}, {"n1", "n2"}) == ()


class _Method:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def remote(self, *args: Any) -> None:
        self.calls.append(args)


class _Rank:
    """A rank actor's handle that records the commands it is sent."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []
        self.command = _Method(self.commands)


def _on_nodes(engine: TrainingEngine, nodes: dict[int, str]) -> list[str]:
    """The engine's groups (one rank each) running on ``nodes``, as their polls report
    it; returns the commands every rank was sent."""
    sent: list[str] = []
    engine.actors = {(g, 0): _Rank() for g in nodes}
    for g, node in nodes.items():
        engine.supervisor.reports[(g, 0)] = RankReport(pid=1, node_id=node)
    engine.command_all = lambda kind, params=None: sent.append(kind)  # type: ignore[method-assign]
    return sent


def _gained(placement_group_id: str) -> PlacementFact:
    """The reservation of one node the booking gained (change 3)."""
    return PlacementFact(
        booking_id="bk",
        resource="booking:bk",
        placement_group="run-r-pg-c3",
        placement_group_id=placement_group_id,
        bundles=1,
    )


def _taken_back(booking_nodes: tuple[str, ...], groups: int) -> ResizeRequest:
    return ResizeRequest(
        request_id="taken-back", replica_groups=groups, requested_at=0.0, node_ids=booking_nodes
    )


def test_the_groups_on_a_node_taken_back_leave_not_the_highest(tmp_path: Path) -> None:
    engine, inbox, _ = _engine(tmp_path)
    sent = _on_nodes(engine, {0: "node-a", 1: "node-b"})
    inbox.put(_taken_back(("node-b",), 1))
    engine.resizer.advance()
    assert engine.resizer.stage is ResizeStage.holding and sent == ["hold"]
    assert engine.resizer.members == (1,)  # group 0 ran on node-a: it leaves


def test_without_the_nodes_mapped_the_highest_groups_leave(tmp_path: Path) -> None:
    engine, inbox, _ = _engine(tmp_path)
    _on_nodes(engine, {0: "node-a", 1: ""})  # a rank outside a multi-node cluster
    inbox.put(_taken_back(("node-b",), 1))
    engine.resizer.advance()
    assert engine.resizer.members == (0,)


def test_a_swap_at_the_same_count_drains_the_taken_back_node_then_grows(
    tmp_path: Path,
) -> None:
    """One node taken back, one gained, two groups still fit: the group on the node
    taken back is drained first, then a group is added (on the gained node)."""
    engine, inbox, events = _engine(tmp_path)
    _on_nodes(engine, {0: "node-a", 1: "node-b"})
    inbox.put(_taken_back(("node-b", "node-c"), 2))
    engine.resizer.advance()
    requested = [e for e in events if isinstance(e, ResizeEvent)]
    assert [(e.action, e.groups_before, e.groups_after) for e in requested] == [("requested", 2, 1)]
    assert engine.resizer.stage is ResizeStage.holding and engine.resizer.members == (1,)
    # Every rank holds after step 7: group 0 is told to stop, group 1 trains alone.
    stays, leaves = engine.actors[(1, 0)], engine.actors[(0, 0)]
    for key in list(engine.actors):
        engine.supervisor.reports[key] = RankReport(
            pid=1, node_id="node-b", state=RankState.held, held_at=7
        )
    engine.resizer.advance()
    assert leaves.commands == [("stop",)]
    assert stays.commands == [("members", {"first_step": 7, "members": [1]})]
    engine.resizer.leaving.clear()  # the drained rank stopped (its poll is Ray's)
    engine.resizer.step_committed(
        StepEvent(step=8, loss=1.0, tokens=384, seconds=0.1, committed=True, batch_share=(0, 1))
    )
    # Then the second move: a group starts where the booking gained a node.
    made: list[tuple[int, Any]] = []

    def make_worker(name: str, group: int, rank: int, **kw: Any) -> _Rank:
        made.append((group, kw["placement"]))
        return _Rank()

    engine.launcher.make_worker = make_worker  # type: ignore[method-assign]
    engine.resizer.advance()
    assert made == [(2, None)] and engine.resizer.stage is ResizeStage.launching
    assert engine.resizer.members == (1, 2)
    actions = [(e.action, e.groups_after) for e in events if isinstance(e, ResizeEvent)]
    assert actions == [("requested", 1), ("applied", 1), ("requested", 2)]


def test_a_swap_with_the_gained_node_reserved_grows_onto_it_first(tmp_path: Path) -> None:
    """The gained node reserved and the batch splitting over one group more: the new
    group starts there first and joins two live groups (a grow), then the group on the
    node taken back drains."""
    engine, inbox, events = _engine(tmp_path)
    _on_nodes(engine, {0: "node-a", 1: "node-b"})
    gained = _gained("ab" * 18)
    made: list[tuple[int, Any]] = []

    def make_worker(name: str, group: int, rank: int, **kw: Any) -> _Rank:
        made.append((group, kw["placement"]))
        return _Rank()

    engine.launcher.make_worker = make_worker  # type: ignore[method-assign]
    inbox.put(_taken_back(("node-b", "node-c"), 2).model_copy(update={"placement": gained}))
    engine.resizer.advance()
    assert made == [(2, gained)] and engine.resizer.stage is ResizeStage.launching
    assert engine.resizer.members == (0, 1, 2)
    actions = [(e.action, e.groups_after) for e in events if isinstance(e, ResizeEvent)]
    assert actions == [("requested", 3)]
    # The new group trains (the resizer admitted it) and the first move applies; then
    # the same request drains group 0, on the node taken back, not group 2, the highest.
    engine.supervisor.add_group(2)
    engine.actors[(2, 0)] = _Rank()
    engine.supervisor.reports[(2, 0)] = RankReport(pid=1, node_id="node-c")
    engine.resizer.joining, engine.resizer.stage = {}, ResizeStage.settling
    engine.resizer.step_committed(
        StepEvent(step=9, loss=1.0, tokens=384, seconds=0.1, committed=True, batch_share=(0, 3))
    )
    engine.resizer.advance()
    assert engine.resizer.stage is ResizeStage.holding and engine.resizer.members == (1, 2)
    actions = [(e.action, e.groups_after) for e in events if isinstance(e, ResizeEvent)]
    assert actions == [("requested", 3), ("applied", 3), ("requested", 2)]


def test_a_share_grown_past_the_plan_trains_in_passes_no_larger_than_the_plans() -> None:
    """A shrink below the planned groups grows each rank's share of the fixed global
    batch: the rank accumulates over more passes, none larger than the plan's, to the
    loss and gradients of the whole share (the plan's memory still holds)."""
    import pytest
    import torch

    from stages.model.lm import build_model, causal_lm_loss
    from stages.presets import load_model_preset
    from stages.trainer.parallel.layout import ParallelLayout
    from stages.trainer.parallel.parallelize import ParallelModel
    from stages.trainer.rank.objective import LanguageModelObjective

    preset = load_model_preset("llama-tiny")
    sizes: list[int] = []  # each forward pass's sequences
    # The plan: 4 sequences a rank, in 2 passes of 2. A shrink to half the groups gives
    # 8 a rank, one from 3 groups to 2 gives 6.
    for rows, passes in ((4, 2), (6, 3), (8, 4)):
        ids = torch.randint(
            0, preset.vocab_size, (rows, 32), generator=torch.Generator().manual_seed(rows)
        )
        whole = build_model(preset, seed=0)
        expected = causal_lm_loss(whole, ids)
        expected.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        model = ParallelModel(
            build_model(preset, seed=0),
            ParallelLayout(grad_accum=2),
            None,
            torch.device("cpu"),
            planned_micro_batch_at=lambda seq_len: 4,
        )
        sizes.clear()
        model.module.register_forward_pre_hook(
            lambda _m, _a, kw: sizes.append(int(kw["input_ids"].shape[0])), with_kwargs=True
        )
        loss = model.forward_backward(
            LanguageModelObjective.batch_of(ids), LanguageModelObjective(None)
        )
        assert sizes == [2] * passes, rows
        assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-5)
        for p, q in zip(model.module.parameters(), whole.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.allclose(p.grad, q.grad, atol=1e-6), rows


def test_a_pipelined_run_keeps_its_planned_groups(tmp_path: Path) -> None:
    """A pipeline's micro-batch count is fixed with its schedule: fewer groups than
    planned would grow each micro-batch past the plan's memory, so that is refused;
    more groups, or a pause, are not."""
    engine, inbox, events = _engine(tmp_path, ranks_per_group=2, parallel={"pp": 2})
    answer = _answer(engine, inbox, events, 1)
    assert (answer.action, answer.groups_after) == ("refused", 2)
    assert "pipelined run keeps its planned 2 replica groups" in answer.reason
    for groups in (3, 0):
        request = ResizeRequest(request_id=f"to-{groups}", replica_groups=groups, requested_at=0)
        assert engine.resizer.refusal(request) == ""


def _warm_standby(engine: TrainingEngine) -> tuple[_Rank, list[tuple[int, Any]]]:
    """One warm standby group (one rank) in the engine's pool; returns its actor and
    the (standby index, placement) of every standby the pool starts from now on."""
    started: list[tuple[int, Any]] = []

    def make(name: str, rank: int, index: int, placement: Any, place: Any) -> _Rank:
        started.append((index, placement))
        return _Rank()

    engine.standby.make = make
    engine.standby.start_one()
    started.clear()
    (name,) = engine.standby.groups[0]
    engine.standby.ready.add(name)
    return engine.standby.spares[name], started


def test_a_grow_promotes_an_idle_warm_standby_and_starts_its_replacement(
    tmp_path: Path,
) -> None:
    """With a warm standby idle, the new group is that standby: nothing is launched, the
    run holds at once, the standby is activated as the new group at the held step (it
    heals, reading no checkpoint) and a replacement standby starts on the gained node."""
    engine, inbox, events = _engine(tmp_path)
    sent = _on_nodes(engine, {0: "node-a", 1: "node-b"})
    standby, started = _warm_standby(engine)

    def make_worker(name: str, group: int, rank: int, **kw: Any) -> _Rank:
        raise AssertionError(f"launched {name}: the warm standby should have been promoted")

    engine.launcher.make_worker = make_worker  # type: ignore[method-assign]
    gained = _gained("cd" * 18)
    inbox.put(
        ResizeRequest(request_id="grow", replica_groups=3, requested_at=0.0, placement=gained)
    )
    engine.resizer.advance()
    assert engine.resizer.stage is ResizeStage.holding and sent == ["hold"]
    assert engine.resizer.joining == {(2, 0): standby} and engine.resizer.members == (0, 1, 2)
    # The run keeps its standby count: the replacement starts where the booking grew.
    assert started == [(1, gained)] and set(engine.standby.groups) == {1}
    promoted = [e for e in events if isinstance(e, FleetEvent) and e.action == "standby_activated"]
    assert [(e.replica_group, e.actors) for e in promoted] == [(2, [engine.standby.name(0, 0)])]
    assert standby.commands == []  # not before every group holds
    for key in list(engine.actors):
        engine.supervisor.reports[key] = RankReport(pid=1, state=RankState.held, held_at=7)
    engine.resizer.advance()
    assert engine.resizer.stage is ResizeStage.joining and engine.resizer.first_step == 8
    assert [c[0] for c in standby.commands] == ["data", "activate"]
    assert standby.commands[1][1] == {"group": 2, "gpu_ids": [], "joining": True}


def test_a_grow_launches_fresh_ranks_when_no_standby_is_warm(tmp_path: Path) -> None:
    engine, inbox, _ = _engine(tmp_path)
    _on_nodes(engine, {0: "node-a", 1: "node-b"})
    standby, started = _warm_standby(engine)
    engine.standby.ready.clear()  # still warming up
    made: list[int] = []

    def make_worker(name: str, group: int, rank: int, **kw: Any) -> _Rank:
        made.append(group)
        return _Rank()

    engine.launcher.make_worker = make_worker  # type: ignore[method-assign]
    inbox.put(ResizeRequest(request_id="grow", replica_groups=3, requested_at=0.0))
    engine.resizer.advance()
    assert made == [2] and engine.resizer.stage is ResizeStage.launching
    assert started == [] and standby.commands == [] and set(engine.standby.groups) == {0}


def test_a_new_group_lost_before_it_trains_is_launched_again_then_the_grow_is_refused(
    tmp_path: Path,
) -> None:
    """A new group's rank that fails after every group held (before it trains): the held
    groups are released with the members they had (none waits for the lost one), the
    lost group's ranks are killed and fresh ones launched under a new index; once the
    launches run out, the grow is refused and the held groups are released again."""
    engine, inbox, events = _engine(tmp_path, fault_tolerance={"resize_join_attempts": 2})
    _on_nodes(engine, {0: "node-a", 1: "node-b"})
    held_ranks = dict(engine.actors)
    made: dict[int, _Rank] = {}

    def make_worker(name: str, group: int, rank: int, **kw: Any) -> _Rank:
        made[group] = _Rank()
        return made[group]

    engine.launcher.make_worker = make_worker  # type: ignore[method-assign]
    answers: list[tuple[bool, str]] = []
    engine.resizer.polls.all_in = lambda ranks, states, shards: answers.pop(0)  # type: ignore[method-assign]
    inbox.put(ResizeRequest(request_id="grow", replica_groups=3, requested_at=0.0))
    engine.resizer.advance()
    assert list(made) == [2] and engine.resizer.stage is ResizeStage.launching

    def hold_and_lose(new_group: int) -> None:
        answers.append((True, ""))  # built and warm: every group is asked to hold
        engine.resizer.advance()
        for key in held_ranks:
            engine.supervisor.reports[key] = RankReport(pid=1, state=RankState.held, held_at=7)
        engine.resizer.advance()  # all held after step 7: the new group is released
        assert engine.resizer.stage is ResizeStage.joining
        assert made[new_group].commands == [("data", {"role_shards": None}), ("go",)]
        for rank in held_ranks.values():
            rank.commands.clear()
        answers.append((False, f"rank ({new_group}, 0) of a new group failed: gone"))
        engine.resizer.advance()
        released = ("members", {"first_step": 8, "members": [0, 1]})
        assert all(rank.commands == [released] for rank in held_ranks.values())

    hold_and_lose(2)
    assert list(made) == [2, 3] and engine.resizer.stage is ResizeStage.launching
    assert engine.resizer.members == (0, 1, 3) and list(engine.resizer.joining) == [(3, 0)]
    hold_and_lose(3)  # the second and last launch fails too
    assert engine.resizer.stage is ResizeStage.idle and not engine.resizer.joining
    actions = [(e.action, e.groups_after) for e in events if isinstance(e, ResizeEvent)]
    assert actions == [("requested", 3), ("refused", 2)]
    assert sorted(engine.groups) == [0, 1]
