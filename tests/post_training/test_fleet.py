"""The rollout controller: bounded staleness under random delays (property test),
dynamic sampling refills, eta = 0 equals the synchronous loop, versions after a sync.

In-process workers (threads) stand in for the Ray actors here; the Ray fleet with a
real SIGKILL is tests/post_training/test_fleet_ray.py."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.in_process_learner import GRPOLearner, run_synchronous
from helpers.waiting import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.post_training.fleet import DynamicSampler, RolloutController
from stages.post_training.pools import LocalPool
from stages.post_training.rollout import Refusal, RolloutGroup, RolloutRequest, admission_refusal
from tests.post_training.conftest import data_ref


class FakeWorker:
    """Generates instantly-known rewards after a random delay; keeps the real
    worker's admission check. ``uniform(id)`` says which requests come back uniform."""

    def __init__(
        self, index: int, rng: random.Random, max_delay_s: float, uniform: Any = lambda k: False
    ):
        self.index, self.rng, self.max_delay_s, self.uniform = index, rng, max_delay_s, uniform
        self.version = -1
        self.generated: list[int] = []

    def set_weights(self, version: int, state: dict[str, Any]) -> dict[str, float]:
        time.sleep(self.rng.random() * self.max_delay_s / 4)
        self.version = version
        return {"version": version, "load_s": 0.0}

    def identity(self) -> dict[str, int]:
        return {"pid": 0, "index": self.index, "version": self.version}

    def generate(self, req: RolloutRequest) -> RolloutGroup | Refusal:
        refused = admission_refusal(self.version, req, self.index)
        if refused is not None:
            return refused
        v = self.version
        time.sleep(self.rng.random() * self.max_delay_s)
        self.generated.append(req.id)
        r = (
            [1.0] * req.group_size
            if self.uniform(req.id)
            else [float(i % 2) for i in range(req.group_size)]
        )
        return RolloutGroup(
            id=req.id,
            version=v,
            worker=self.index,
            prompt_ids=[1],
            completion_ids=[[2]] * req.group_size,
            behav_logp=[[0.0]] * req.group_size,
            lengths=[1] * req.group_size,
            truncated=[False] * req.group_size,
            rewards=r,
            task_rewards=r,
            gen_s=0.0,
        )


class IgnoresAdmission(FakeWorker):
    """Skips the worker-side admission check and answers its first request after the
    sync to ``lag_from`` with the weights it had before (a sync that raced its rollout):
    only the trainer-side refusal stands between that group and the optimizer."""

    def __init__(self, index: int, lag_from: int):
        super().__init__(index, random.Random(index), 0.0)
        self.lag_from = lag_from
        self.previous = -1
        self.lagged = False

    def set_weights(self, version: int, state: dict[str, Any]) -> dict[str, float]:
        self.previous = self.version
        return super().set_weights(version, state)

    def generate(self, req: RolloutRequest) -> RolloutGroup | Refusal:
        lag = self.version >= self.lag_from and not self.lagged
        self.lagged = self.lagged or lag
        self.generated.append(req.id)
        r = [float(i % 2) for i in range(req.group_size)]
        return RolloutGroup(
            id=req.id,
            version=self.previous if lag else self.version,
            worker=self.index,
            prompt_ids=[1],
            completion_ids=[[2]] * req.group_size,
            behav_logp=[[0.0]] * req.group_size,
            lengths=[1] * req.group_size,
            truncated=[False] * req.group_size,
            rewards=r,
            task_rewards=r,
            gen_s=0.0,
        )


class DiesMidRollout(FakeWorker):
    """Dies inside its rollout of request ``die_on`` (as a SIGKILL mid-generate), fails
    its next ``down_calls`` calls at once (Ray has not seen the death yet), then comes
    back without weights, as a restarted actor does."""

    def __init__(self, index: int, die_on: int, down_calls: int):
        super().__init__(index, random.Random(index), 0.0)
        self.die_on, self.down_calls = die_on, down_calls
        self.down = 0
        self.died = False

    def _unavailable(self) -> None:
        if self.down > 0:
            self.down -= 1
            raise ConnectionError("actor unavailable")

    def set_weights(self, version: int, state: dict[str, Any]) -> dict[str, float]:
        self._unavailable()
        return super().set_weights(version, state)

    def generate(self, req: RolloutRequest) -> RolloutGroup | Refusal:
        self._unavailable()
        if req.id == self.die_on and not self.died:
            self.died, self.version, self.down = True, -1, self.down_calls
            raise ConnectionError("killed mid-rollout")
        return super().generate(req)


def _request(eta: int) -> Any:
    def make(k: int, s: int) -> RolloutRequest:
        return RolloutRequest(
            id=k,
            prompt_ids=[1],
            answer="1",
            group_size=2,
            seed=k,
            consume_step=s,
            max_staleness=eta,
            max_new_tokens=1,
        )

    return make


def _controller(pool: LocalPool, eta: int, G: int, *, drops: int = 0) -> RolloutController:
    return RolloutController(
        pool,
        _request(eta),
        groups_per_step=G,
        max_staleness=eta,
        sampler=DynamicSampler(True, drops),
        rollout_timeout_s=30,
        restart_timeout_s=30,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    eta=st.integers(0, 3),
    workers=st.integers(1, 4),
    G=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    uniform_every=st.integers(0, 4),
)
def test_no_trained_sample_is_older_than_eta(
    eta: int, workers: int, G: int, seed: int, uniform_every: int
) -> None:
    rng = random.Random(seed)
    pool = LocalPool(
        [
            FakeWorker(
                i,
                random.Random(rng.random()),
                0.004,
                uniform=(lambda k, u=uniform_every: u > 0 and k % u == 0),
            )
            for i in range(workers)
        ]
    )
    ctl = _controller(pool, eta, G, drops=2)
    try:
        ctl.publish(0, {})
        for step in range(6):
            batch, _ = ctl.next_batch()
            assert len(batch) == G
            for g in batch:
                assert 0 <= step - g.version <= eta
            # The trainer's step takes a random while; the fleet generates meanwhile.
            ctl.pump_while(lambda: time.sleep(rng.random() * 0.004))
            ctl.publish(step + 1, {})
        assert ctl.stats.stale_refused == 0  # admission already kept every sample fresh
        assert max(ctl.stats.staleness) <= eta
    finally:
        pool.close()


def test_eta_above_zero_lets_rollouts_overlap_training() -> None:
    pool = LocalPool([FakeWorker(i, random.Random(i), 0.01) for i in range(2)])
    ctl = _controller(pool, 2, 2)
    try:
        ctl.publish(0, {})
        for step in range(6):
            ctl.next_batch()
            ctl.pump_while(lambda: time.sleep(0.02))
            ctl.publish(step + 1, {})
        assert max(ctl.stats.staleness) >= 1  # generated under older versions ...
        assert max(ctl.stats.staleness) <= 2  # ... never older than eta
    finally:
        pool.close()


def test_uniform_groups_are_dropped_and_refilled() -> None:
    uniform_ids = {0, 2, 3}
    worker = FakeWorker(0, random.Random(0), 0.0, uniform=lambda k: k in uniform_ids)
    pool = LocalPool([worker])
    ctl = _controller(pool, 0, 3, drops=10)
    try:
        ctl.publish(0, {})
        batch, walked = ctl.next_batch()
        assert [g.id for g in batch] == [1, 4, 5]  # refilled by ids 4 and 5
        assert [g.id for g in walked] == [0, 1, 2, 3, 4, 5]
        assert ctl.stats.groups_dropped == 3
        assert ctl.stats.summary(1)["drop_rate"] == pytest.approx(0.5)
    finally:
        pool.close()


def test_dynamic_sampling_bound_keeps_uniform_groups_after_max_drops() -> None:
    worker = FakeWorker(0, random.Random(0), 0.0, uniform=lambda k: True)
    pool = LocalPool([worker])
    ctl = _controller(pool, 0, 2, drops=3)
    try:
        ctl.publish(0, {})
        batch, walked = ctl.next_batch()
        assert [g.id for g in batch] == [3, 4]  # 0..2 dropped, then the bound is reached
        assert len(walked) == 5
    finally:
        pool.close()


def test_trainer_refuses_a_stale_group_and_regenerates_it() -> None:
    worker = IgnoresAdmission(0, lag_from=1)
    pool = LocalPool([worker])
    ctl = _controller(pool, 0, 1)  # eta = 0: only groups of the training version
    try:
        ctl.publish(0, {})
        first, _ = ctl.next_batch()
        ctl.publish(1, {})
        second, walked = ctl.next_batch()
        assert [(g.id, g.version) for g in first] == [(0, 0)]
        # Request 1 came back from version 0 while the trainer is at 1: refused, asked
        # again under the same id, and the fresh answer is what trains.
        assert ctl.stats.stale_refused == 1
        assert worker.generated == [0, 1, 1]
        assert [(g.id, g.version) for g in second] == [(1, 1)]
        assert [(g.id, g.version) for g in walked] == [(1, 1)]
        assert ctl.stats.staleness == [0, 0]
        assert ctl.stats.summary(1)["stale_refused"] == 1.0
    finally:
        pool.close()


def test_a_death_seen_by_several_failed_calls_is_one_loss_and_one_discarded_rollout() -> None:
    worker = DiesMidRollout(0, die_on=1, down_calls=6)
    pool = LocalPool([worker])
    # One loss allowed: the calls that fail while the worker is down are that one loss,
    # the weight publish that lands in the outage included.
    ctl = RolloutController(
        pool,
        _request(1),
        groups_per_step=1,
        max_staleness=1,
        sampler=DynamicSampler(True, 0),
        rollout_timeout_s=60,
        restart_timeout_s=60,
        max_worker_losses=1,
    )
    try:
        ctl.publish(0, {})
        ctl.next_batch()
        # Request 1 is generated while the trainer trains, and the worker dies in it.
        ctl.pump_while(lambda: wait_until(lambda: worker.died, 30, "the worker's death"))
        ctl.publish(1, {})
        batch, _ = ctl.next_batch()
        assert [(g.id, g.version) for g in batch] == [(1, 1)]  # regenerated after the heal
        assert worker.down == 0 and worker.generated == [0, 1]
        assert ctl.stats.discarded_rollouts == 1
        assert ctl.stats.interruptions == 1
    finally:
        pool.close()


def test_an_empty_wait_waits_its_timeout_instead_of_returning_at_once() -> None:
    """The RLVR pump loops on ``pool.wait`` while the learner trains; with nothing in
    flight a wait that returned at once made it spin and starve the in-process rollout
    threads of the GIL. A rate bound, not a speed claim: a slower host meets it too."""
    pool = LocalPool([FakeWorker(0, random.Random(0), 0.0)])
    timeout_s = 0.005
    try:
        calls, started = 50, time.monotonic()
        for _ in range(calls):
            assert pool.wait([], timeout_s) == []
        assert calls <= (time.monotonic() - started) / timeout_s + 1
    finally:
        pool.close()


def test_after_a_sync_every_worker_reports_the_trainer_version() -> None:
    pool = LocalPool([FakeWorker(i, random.Random(i), 0.002) for i in range(3)])
    ctl = _controller(pool, 1, 2)
    try:
        ctl.publish(0, {})
        for step in range(3):
            ctl.next_batch()
            ctl.publish(step + 1, {})
        ctl.drain_syncs(10)
        assert pool.versions(10) == [3, 3, 3]
    finally:
        pool.close()


def _rl_setup(tiny_policy: Path, task_files: dict[str, Path], eta: int) -> tuple[Any, ...]:
    from stages.post_training.config import RLVRConfig
    from stages.post_training.data import load_rows
    from stages.post_training.hf_io import load_model, load_tokenizer
    from stages.post_training.rl import RequestMaker
    from stages.post_training.rollout import RolloutWorker, WorkerSpec, encode_prompts

    cfg = RLVRConfig.model_validate(
        {
            "data": data_ref(task_files["rlvr"]),
            "steps": 3,
            "reward": "first_number_match",
            "group_size": 4,
            "groups_per_step": 2,
            "max_completion_tokens": 4,
            "overlong_buffer_tokens": 2,
            "overlong_penalty_factor": 0.5,
            "learning_rate": 1e-2,
            "max_staleness": eta,
        }
    )
    tok = load_tokenizer(tiny_policy)
    learner = GRPOLearner(cfg, load_model(tiny_policy), tok.pad_token_id)
    spec = WorkerSpec(
        index=0,
        model_dir=str(tiny_policy),
        reward=cfg.reward,
        max_completion_tokens=4,
        overlong_buffer_tokens=2,
        overlong_penalty_factor=0.5,
    )
    rows = load_rows("rlvr", cfg.data.uri)
    maker = RequestMaker(cfg, encode_prompts(tok, rows), rows)
    return cfg, learner, maker, lambda i: RolloutWorker(spec.model_copy(update={"index": i}))


def test_eta_zero_gives_the_same_updates_as_the_synchronous_loop(
    tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    from stages.post_training.rl import run_rlvr

    cfg, sync_learner, maker, make_worker = _rl_setup(tiny_policy, task_files, 0)
    run_synchronous(cfg, sync_learner, make_worker(0), maker)

    cfg, fleet_learner, maker, make_worker = _rl_setup(tiny_policy, task_files, 0)
    pool = LocalPool([make_worker(i) for i in range(3)])
    try:
        result, ctl = run_rlvr(cfg, fleet_learner, pool, maker)
    finally:
        pool.close()
    assert result.steps == 3 and fleet_learner.version == 3
    assert ctl.stats.staleness and max(ctl.stats.staleness) == 0
    a, b = sync_learner.model.state_dict(), fleet_learner.model.state_dict()
    start = _rl_setup(tiny_policy, task_files, 0)[1].model.state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)  # training did change weights
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _keeps_old_weights(spec: Any) -> Any:
    """A real RolloutWorker that skips its own admission check and keeps the weights of
    its first sync while acknowledging every later one: from step eta + 1 on, every
    group it offers is older than eta (the worker is wrong, the trainer must not be)."""
    from stages.post_training.rollout import RolloutWorker

    class KeepsOldWeights(RolloutWorker):
        offered: list[int]

        def set_weights(self, version: int, state: dict[str, Any]) -> dict[str, float]:
            if self.version < 0:
                self.offered = []
                return super().set_weights(version, state)
            return {"version": version, "load_s": 0.0}

        def generate(self, req: RolloutRequest) -> RolloutGroup | Refusal:
            g = self.rollout(req)  # no admission check
            self.offered.append(g.version)
            return g

    return KeepsOldWeights(spec)


def test_no_sample_a_worker_wrongly_offers_is_trained(
    tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    from stages.post_training.rl import run_rlvr

    cfg, learner, maker, make_worker = _rl_setup(tiny_policy, task_files, 0)
    honest = make_worker(0)
    rogue = _keeps_old_weights(honest.spec.model_copy(update={"index": 1}))
    pool = LocalPool([honest, rogue])
    try:
        result, ctl = run_rlvr(cfg, learner, pool, maker)
    finally:
        pool.close()
    assert result.steps == cfg.steps
    assert any(cfg.steps - 1 - v > cfg.max_staleness for v in rogue.offered)  # it did offer
    assert ctl.stats.stale_refused > 0 and result.summary["stale_refused"] > 0
    assert learner.trained and all(step - v <= cfg.max_staleness for step, v in learner.trained), (
        learner.trained
    )
    assert {step for step, _ in learner.trained} == set(range(cfg.steps))


def test_the_learner_itself_refuses_a_group_older_than_eta(
    tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    """Handed straight to the learner (no controller walk in between), a group older
    than eta is dropped and counted; the fresh ones train."""
    _cfg, learner, maker, make_worker = _rl_setup(tiny_policy, task_files, 0)
    worker = make_worker(0)
    worker.set_weights(0, learner.state())
    old = worker.generate(maker(0, 0))
    learner.step([old, worker.generate(maker(1, 0))])  # version 0 -> 1
    worker.set_weights(1, learner.state())
    fresh = worker.generate(maker(2, 1))
    assert isinstance(old, RolloutGroup) and isinstance(fresh, RolloutGroup)
    stats = learner.step([old, fresh])  # old is version 0, the learner is at 1, eta 0
    assert stats.stale_refused == 1
    assert learner.trained == [(0, 0), (0, 0), (1, 1)]
    stats = learner.step([old])  # nothing fresh: no update
    assert stats.stale_refused == 1 and stats.tokens == 0 and learner.trained[-1] == (1, 1)


def test_the_engine_learner_keeps_a_group_older_than_eta_out_of_the_batch_file(
    ray_local: None, tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    """The engine's learner (driver side) refuses a stale group a worker wrongly
    offers where the step's batch is assembled: its rows in the file the ranks train
    are padding (mask 0, version -1) and it is not recorded as trained. The ranks'
    committed versions are stood in for by offers on a real weight board, made up
    front."""
    import threading

    import ray

    from stages.post_training.grpo_objective import assemble, wait_for
    from stages.post_training.learner import EngineLearner
    from stages.post_training.step_groups import step_groups_path
    from stages.post_training.weight_board import board_name, start_board
    from stages.post_training.weight_descriptors import ObjectStoreWeights, PublishedVersion

    cfg, learner, maker, make_worker = _rl_setup(tiny_policy, task_files, 0)
    worker = make_worker(0)
    worker.set_weights(0, learner.state())
    old = worker.generate(maker(0, 0))
    worker.set_weights(1, learner.state())
    fresh = worker.generate(maker(1, 1))
    assert isinstance(old, RolloutGroup) and isinstance(fresh, RolloutGroup)
    assert (old.version, fresh.version) == (0, 1)
    board = start_board(board_name("stale", "t"), 1)
    for v in (1, 2):
        weights = ObjectStoreWeights(ref=ray.put({}), bytes=0)
        assert ray.get(board.offer.remote(PublishedVersion(v, weights, 0.5, 0.0)))
    engine = EngineLearner(
        cfg,
        tmp_path,
        pad_id=0,
        base=tiny_policy,
        engine_done=threading.Event(),
        step_timeout_s=30,
        board=board,
    )
    engine.version = 1  # the step this batch trains at
    stats = engine.step([old, fresh])
    assert stats.stale_refused == 1 and engine.trained == [(1, 1)] and engine.version == 2
    # What the ranks train: the step's groups as written, made into tensors on a rank.
    written = assemble(wait_for(step_groups_path(tmp_path / "rollouts", 1), 0, "step 1"))
    g = cfg.group_size
    assert written["versions"].tolist() == [-1] * g + [1] * g
    assert float(written["mask"][:g].sum()) == 0.0 and float(written["mask"][g:].sum()) > 0
    assert engine.losses[2] == 0.5
    ray.kill(board, no_restart=True)


def test_a_worker_encodes_prompts_before_its_model_has_loaded(
    tiny_policy: Path, task_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RLVR's start waits for worker 0's encoding of the prompts: it is answered once
    the tokenizer is loaded, while the model (most of the start-up) still loads; what
    needs the model waits for it."""
    import threading

    from stages.post_training import hf_io
    from stages.post_training.data import load_rows
    from stages.post_training.rollout import RolloutWorker, WorkerSpec, encode_prompts

    release = threading.Event()
    load = hf_io.load_model

    def slow_load(path: Path) -> object:
        assert release.wait(60), "the test never released the model"
        return load(path)

    monkeypatch.setattr(hf_io, "load_model", slow_load)
    spec = WorkerSpec(
        index=0,
        model_dir=str(tiny_policy),
        reward="first_number_match",
        max_completion_tokens=4,
        overlong_buffer_tokens=2,
        overlong_penalty_factor=0.0,
    )
    worker = RolloutWorker(spec)
    rows = load_rows("rlvr", str(data_ref(task_files["rlvr"])["uri"]))
    got = worker.encode_prompts(rows)  # the model is still held back
    assert got == encode_prompts(hf_io.load_tokenizer(tiny_policy), rows)
    assert worker._model is None
    release.set()
    assert worker.identity()["version"] == -1  # up: the model is loaded
    assert worker._model is not None


def test_prompts_over_max_prompt_tokens_are_left_out_and_none_left_is_refused(
    tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    """The planner sizes the learner's step at max_prompt_tokens + completion: a longer
    prompt is never requested, and a dataset with no prompt short enough is refused."""
    from stages.errors import ErrorCode, ItoError
    from stages.post_training.config import RLVRConfig
    from stages.post_training.hf_io import load_tokenizer
    from stages.post_training.rl import RequestMaker
    from stages.post_training.rollout import encode_prompts, prompt_ids

    tok = load_tokenizer(tiny_policy)
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "x" * 400, "answer": "3"}]
    short = len(prompt_ids(tok, rows[0]["prompt"]))
    assert short < len(prompt_ids(tok, rows[1]["prompt"]))
    cfg = RLVRConfig.model_validate(
        {"data": data_ref(task_files["rlvr"]), "steps": 1, "max_prompt_tokens": short}
    )
    maker = RequestMaker(cfg, encode_prompts(tok, rows), rows)
    assert {maker(k, 0).answer for k in range(6)} == {"2"}
    with pytest.raises(ItoError) as e:
        RequestMaker(
            cfg.model_copy(update={"max_prompt_tokens": short - 1}), encode_prompts(tok, rows), rows
        )
    assert e.value.code is ErrorCode.data_empty


def test_the_rlvr_driver_side_builds_no_tensor_and_loads_no_torch_or_tokenizer(
    tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    """The driver's part of the RLVR objective on the engine, in a fresh process: the
    request maker on the prompts a rollout worker encoded, the controller, and a step's
    groups written for the ranks as the engine learner writes them; neither torch (the
    ranks make the tensors) nor transformers (the workers hold the tokenizer) loads."""
    from helpers.fresh_python import run_python

    from stages.post_training.data import load_rows
    from stages.post_training.grpo_objective import assemble, wait_for
    from stages.post_training.hf_io import load_tokenizer
    from stages.post_training.rollout import encode_prompts
    from stages.post_training.step_groups import step_groups_path

    cfg = _rl_setup(tiny_policy, task_files, 0)[0]
    rows = load_rows("rlvr", cfg.data.uri)
    loaded = run_python(
        "import json, sys\n"
        "from pathlib import Path\n"
        "import stages.post_training.stage, stages.post_training.learner\n"
        "import stages.post_training.rl, stages.post_training.fleet\n"
        "from stages.post_training.config import RLVRConfig\n"
        "from stages.post_training.data import load_rows\n"
        "from stages.post_training.rl import RequestMaker\n"
        "from stages.post_training.rollout import PromptEncoding, RolloutGroup\n"
        "from stages.post_training.step_groups import step_groups, write_step_groups\n"
        "cfg = RLVRConfig.model_validate_json(sys.stdin.readline())\n"
        "policy, out = Path(sys.stdin.readline().strip()), Path(sys.stdin.readline().strip())\n"
        "prompts = PromptEncoding.model_validate_json(sys.stdin.readline())\n"
        "maker = RequestMaker(cfg, prompts, load_rows('rlvr', cfg.data.uri))\n"
        "req = maker(0, 0)\n"
        "n = cfg.group_size\n"
        "g = RolloutGroup(id=0, version=0, worker=0, prompt_ids=req.prompt_ids,\n"
        "    completion_ids=[[5, 6]] * n, behav_logp=[[-1.0, -1.0]] * n, lengths=[2] * n,\n"
        "    truncated=[False] * n, rewards=[float(i) for i in range(n)],\n"
        "    task_rewards=[0.0] * n, gen_s=0.0)\n"
        "write_step_groups(step_groups(0, [g, None], cfg, prompts.pad_id), out)\n"
        "top = {m.split('.')[0] for m in sys.modules}\n"
        "print(json.dumps(sorted(top & {'torch', 'transformers', 'tokenizers'})))",
        stdin="\n".join(
            [
                cfg.model_dump_json(),
                str(tiny_policy),
                str(tmp_path),
                encode_prompts(load_tokenizer(tiny_policy), rows).model_dump_json(),
            ]
        )
        + "\n",
    )
    assert loaded == []
    # The ranks' side of the same file: the refused group is padding, the other trains.
    batch = assemble(wait_for(step_groups_path(tmp_path, 0), 0, "step 0"))
    assert batch["versions"].tolist() == [0] * cfg.group_size + [-1] * cfg.group_size
    assert float(batch["mask"].sum()) == 2 * cfg.group_size
