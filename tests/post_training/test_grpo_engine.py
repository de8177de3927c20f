"""The GRPO/DAPO learner on the training engine: real local Ray, torchft replica
groups, gloo, DCP, fed with step batches written the way the driver's controller
writes them (``learner.assemble`` of rollout groups; the groups are synthetic here,
so the engine's side is tested without a fleet).

Two learner replica groups, and one group of two FSDP ranks, must make the same
update as one rank with the whole batch: each rank's summed token loss is divided by
the global batch's completion token count over the ranks (DAPO's token-level mean),
and torchft averages the gradients over the groups. The rank that saves also
publishes each committed version for the fleet to a real weight board
(``helpers.weight_board`` takes them as the driver would): the test compares the
last versions' tensors.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine_heal import kill_one_group_and_heal
from helpers.weight_board import BoardTaker

from stages.events import Event, StepEvent
from stages.post_training.config import RLVRConfig
from stages.post_training.rollout import RolloutGroup
from stages.post_training.step_groups import step_groups, write_step_groups
from stages.trainer.config import TrainStageConfig

pytestmark = pytest.mark.slow

STEPS = 3
LR = 1e-3


def _rlvr(**kw: Any) -> RLVRConfig:
    ref = {
        "uri": "file:///x.jsonl",
        "sha256": "0" * 64,
        "provenance": {"source": "s", "license": "MIT"},
    }
    base = {
        "data": ref,
        "steps": STEPS,
        "group_size": 4,
        "groups_per_step": 2,
        "learning_rate": LR,
        "max_completion_tokens": 8,
        "overlong_buffer_tokens": 2,
        "temperature": 0.7,
    }
    return RLVRConfig.model_validate({**base, **kw})


def _groups(step: int, cfg: RLVRConfig, vocab: int) -> list[RolloutGroup]:
    """Groups of different prompt and completion lengths, never uniform rewards, with
    behaviour log-probs away from the policy's (the importance weight bites)."""
    gen = torch.Generator().manual_seed(step)
    out = []
    for gi in range(cfg.groups_per_step):
        prompt = torch.randint(3, vocab, (3 + gi + step % 2,), generator=gen).tolist()
        lengths = [1 + int(x) for x in torch.randint(0, 8, (cfg.group_size,), generator=gen)]
        comps = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        rewards = torch.rand(cfg.group_size, generator=gen).tolist()
        out.append(
            RolloutGroup(
                id=step * 10 + gi,
                version=step,
                worker=0,
                prompt_ids=prompt,
                completion_ids=comps,
                behav_logp=[(-2.0 - torch.rand(n, generator=gen)).tolist() for n in lengths],
                lengths=lengths,
                truncated=[False] * cfg.group_size,
                rewards=rewards,
                task_rewards=rewards,
                gen_s=0.0,
            )
        )
    return out


def _write_batches(work: Path, cfg: RLVRConfig, steps: int, vocab: int, pad: int) -> None:
    for k in range(steps):
        write_step_groups(step_groups(k, list(_groups(k, cfg, vocab)), cfg, pad), work / "rollouts")


def _config(
    work: Path, policy: Path, cfg: RLVRConfig, groups: int, board: str, **kw: Any
) -> TrainStageConfig:
    from stages.post_training.learner import rlvr_train_config

    tcfg = rlvr_train_config(
        cfg,
        base=policy,
        work=work,
        max_prompt_tokens=8,
        train=None,
        device="cpu",
        weights_board=board,
        fleet_workers=1,
    )
    return TrainStageConfig.model_validate(
        {**tcfg.model_dump(), "replica_groups": groups, **kw}, strict=False
    )


def _engine(cfg: TrainStageConfig, work: Path, run_id: str, emit: Any) -> Any:
    from stages.trainer.fleet.engine import TrainingEngine

    return TrainingEngine(
        cfg,
        run_id=run_id,
        checkpoint_dir=work / "checkpoints",
        role_shards={},
        emit=emit,
        cancel_event=threading.Event(),
        wait_decision=lambda _id, _t: None,
    )


def _policy_facts(policy: Path) -> tuple[int, int]:
    from stages.post_training.hf_io import load_tokenizer

    tok = load_tokenizer(policy)
    return int(tok.vocab_size), int(tok.pad_token_id)


def test_two_grpo_learner_groups_or_two_fsdp_ranks_make_the_update_of_one_rank(
    ray_local: None, tiny_policy: Path, tmp_path: Path
) -> None:
    """The same global batch on two replica groups, on one group of two FSDP ranks
    (whose rank 0 publishes the gathered full tensors), and on one rank."""
    from stages.post_training.hf_io import load_model

    cfg = _rlvr()
    vocab, pad = _policy_facts(tiny_policy)
    layouts: dict[str, dict[str, Any]] = {
        "g2": {"replica_groups": 2},
        "fsdp2": {"ranks_per_group": 2, "parallel": {"dp_shard": 2}, "worker_num_cpus": 0.5},
        "g1": {},
    }
    runs: dict[str, tuple[Any, list[Event], BoardTaker]] = {}
    for name, layout in layouts.items():
        work = tmp_path / name
        _write_batches(work, cfg, STEPS, vocab, pad)
        taker = BoardTaker(STEPS)
        tcfg = _config(work, tiny_policy, cfg, 1, taker.name, **layout)
        assert tcfg.micro_batch == 8 // tcfg.dp_world  # the same global batch
        events: list[Event] = []
        result = _engine(tcfg, work, f"grpo-{name}", events.append).run()
        runs[name] = (result, events, taker)
    (r2, ev2, _), (r1, ev1, taker1) = runs["g2"], runs["g1"]
    assert r2.steps == r1.steps == runs["fsdp2"][0].steps == STEPS
    assert len(set(r2.digests.values())) == 1 and len(r2.digests) == 2  # groups agree
    steps2 = [e for e in ev2 if isinstance(e, StepEvent) and e.committed and e.replica_group == 0]
    steps1 = [e for e in ev1 if isinstance(e, StepEvent) and e.committed]
    assert [e.quorum_size for e in steps2] == [2] * STEPS
    for a, b in zip(steps2, steps1, strict=True):  # the global batch's token mean
        assert a.loss == pytest.approx(b.loss, rel=1e-4, abs=1e-7)

    # Every committed version was published for the fleet, the last one is the final.
    w1 = taker1.join()
    w0 = load_model(tiny_policy).state_dict()
    update = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
    assert update > 0.5 * LR  # AdamW moves a weight by ~LR a step
    for name in ("g2", "fsdp2"):
        taker = runs[name][2]
        w = taker.join()
        assert taker.taken == taker1.taken == list(range(1, STEPS + 1))
        assert set(w) == set(w1)  # full tensors, whatever the ranks hold
        diff = max(float((w[k] - w1[k]).abs().max()) for k in w1)
        # Tolerance as for SFT (test_objective_engine.py): the same per-token terms
        # summed in another order, passed on by AdamW; a per-rank token mean instead of
        # the global one reweights the completions and moves the update by percents.
        print(f"{name} vs one grpo rank: max weight diff {diff:.3g}, max update {update:.3g}")
        assert diff <= 1e-3 * update, (name, diff, update)


@pytest.mark.timeout(600)
def test_a_killed_grpo_learner_group_heals_bit_identical(
    ray_local: None, tiny_policy: Path, tmp_path: Path
) -> None:
    """SIGKILL one of two GRPO learner groups mid-run: the survivor commits alone, Ray
    restarts the lost one, which heals from the live peer and rejoins; both groups end
    with bit-identical weights, and every version was published (the last by a
    group that trained to the end)."""
    # While group 1 is lost the survivor steps at 0.5 s: the run outlasts its restart
    # however slow the host, and ends soon after the group rejoined.
    steps = 150
    cfg = _rlvr(steps=steps)
    vocab, pad = _policy_facts(tiny_policy)
    work = tmp_path / "heal"
    _write_batches(work, cfg, steps, vocab, pad)
    taker = BoardTaker(steps)
    tcfg = _config(
        work, tiny_policy, cfg, 2, taker.name, pace_step_s=0.05, degraded_pace_step_s=0.5
    )

    def make_engine(emit: Any, cancel: threading.Event) -> Any:
        engine = _engine(tcfg, work, "grpo-heal", emit)
        engine.cancel_event = cancel
        return engine

    r = kill_one_group_and_heal(make_engine, "grpo-heal").result
    assert r.steps == steps
    assert set(r.digests) == {0, 1} and r.digests[0] == r.digests[1], r.digests
    taker.join()
    assert taker.taken == list(range(1, steps + 1))


def test_the_wait_for_a_rollout_batch_is_the_batchs_idle_time_not_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that asks for a batch the fleet has not written yet reports how long it
    waited (the loop leaves it out of the step's productive seconds and reports it as
    an idle span); a retry of the same batch did not wait again. Pure: no Ray; the
    wait for the file is a stub on a fake clock."""
    from types import SimpleNamespace

    from stages.post_training import grpo_objective
    from stages.post_training.grpo_objective import GRPOObjective
    from stages.trainer.config import GRPOSettings

    cfg = _rlvr()
    clock = [100.0]
    doc = step_groups(0, list(_groups(0, cfg, vocab=50)), cfg, 0)

    def written_after_7_5_s(path: Path, timeout_s: float, what: str) -> Any:
        clock[0] += 7.5
        return doc

    monkeypatch.setattr(grpo_objective, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(grpo_objective, "wait_for", written_after_7_5_s)
    objective = GRPOObjective(GRPOSettings(), tmp_path / "rollouts", dp_rank=0, dp_world=1)
    assert objective.batch(0).waited_s == 7.5
    assert objective.batch(0).waited_s == 0.0  # the retry's batch was there
