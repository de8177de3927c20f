"""The weight board accepts exactly the versions the driver will take, one publisher
each (on the collective path an accepted offer is a broadcast every worker must
join), and a worker that cannot fetch a version its publisher owned keeps its own.

The board's rules run on its class directly (its methods are coroutines: no Ray
needed); the lost object is real: put by an actor that is then killed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.waiting import wait_until
from helpers.weight_board import sync_only_controller

from stages.post_training.weight_board import BOARD_KEEP, WeightBoard
from stages.post_training.weight_descriptors import ObjectStoreWeights, PublishedVersion


def _offer(v: int) -> PublishedVersion:
    return PublishedVersion(v, ObjectStoreWeights(ref=None, bytes=0), loss=float(v), put_s=0.0)


def test_the_board_takes_each_wanted_version_once_and_nothing_the_driver_passed() -> None:
    async def scenario() -> None:
        board = WeightBoard(first_wanted=3)  # a resume at checkpoint 3
        assert not await board.offer(_offer(2))  # before the resume: never taken
        assert await board.offer(_offer(3))
        assert not await board.offer(_offer(3))  # a second publisher: refused
        got = await board.take(3, timeout_s=1.0)
        assert got is not None and got.loss == 3.0
        assert not await board.offer(_offer(3))  # a restored rank re-committing it
        assert await board.take(4, timeout_s=0.05) is None  # not offered yet
        for v in range(4, 4 + BOARD_KEEP + 2):  # nobody takes: only the newest stay
            assert await board.offer(_offer(v))
        assert sorted(board.held) == list(range(4 + 2, 4 + BOARD_KEEP + 2))
        assert not await board.wait_released(7, timeout_s=0.05)
        await board.release(7)
        assert await board.wait_released(7, timeout_s=1.0)
        assert (await board.stats())["taken"] == 3

    asyncio.run(scenario())


def test_a_board_started_ahead_begins_where_its_run_resumes() -> None:
    """The stage starts the board while the objectives before RLVR train and tells it
    the resume step at RLVR's start, before any rank can offer."""

    async def scenario() -> None:
        board = WeightBoard(first_wanted=1)
        await board.begin_at(3)
        assert not await board.offer(_offer(2))
        assert await board.offer(_offer(3))
        assert (await board.stats())["taken"] == 2
        with pytest.raises(RuntimeError):  # it has accepted a version: too late
            await board.begin_at(1)
        assert await board.take(3, timeout_s=1.0) is not None

    asyncio.run(scenario())


def _actor_dead(actor: object) -> bool:
    import ray

    try:
        ray.get(actor.ping.remote(), timeout=30)  # type: ignore[attr-defined]
    except ray.exceptions.RayActorError:
        return True
    return False


def _object_lost(ref: object) -> bool:
    """Whether Ray reports the object lost (its owner's death reaches the object
    directory a moment after the actor is gone)."""
    import ray

    try:
        ray.get(ref, timeout=30)
    except ray.exceptions.ObjectLostError:
        return True
    return False


def test_a_worker_that_cannot_fetch_a_version_keeps_its_own(
    ray_local: None, tiny_policy: Path
) -> None:
    """The version's owner (standing in for a learner rank 0) dies before the worker
    fetches: the worker stays at its version and says which one it missed, and the
    controller then admits against the worker's real version."""
    import ray
    import torch

    from stages.post_training.hf_io import load_model
    from stages.post_training.pools import LocalPool
    from stages.post_training.rollout import RolloutWorker, WorkerSpec
    from stages.post_training.weight_descriptors import BaseWeights, state_digest

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self, state: dict[str, torch.Tensor]) -> list[ray.ObjectRef]:
            return [ray.put(state)]  # nested: the ref stays owned by this actor

        def ping(self) -> None:
            return None

    spec = WorkerSpec(
        index=0,
        model_dir=str(tiny_policy),
        reward="first_number_match",
        max_completion_tokens=4,
        overlong_buffer_tokens=2,
        overlong_penalty_factor=0.5,
        fetch_timeout_s=60.0,
    )
    worker = RolloutWorker(spec)
    base = state_digest(dict(load_model(tiny_policy).state_dict()))
    owner = Owner.remote()  # type: ignore[attr-defined]
    changed = {k: v + 1.0 for k, v in load_model(tiny_policy).state_dict().items()}
    (ref,) = ray.get(owner.put.remote(changed), timeout=120)
    ray.kill(owner, no_restart=True)
    # ray.kill is asynchronous: a call sent right after it may still be served
    wait_until(lambda: _actor_dead(owner), 120, "the killed owner refuses calls")
    wait_until(lambda: _object_lost(ref), 120, "the object is lost with its owner")
    lost = ObjectStoreWeights(ref=ref, bytes=0)

    pool = LocalPool([worker])
    ctl = sync_only_controller(pool, 120)
    try:
        ctl.publish(0, BaseWeights(model_dir=str(tiny_policy)))
        ctl.drain_syncs(120)
        assert worker.version == 0 and worker.weights_digest() == base
        ack = worker.set_weights(1, lost)
        assert (ack["version"], ack["missed"]) == (0, 1), ack
        assert worker.version == 0 and worker.weights_digest() == base
        ctl.publish(1, PublishedVersion(1, lost, loss=0.0, put_s=0.0))
        ctl.drain_syncs(120)
        assert ctl.known_version == [0]  # admission sees the worker's real version
        assert ctl.stats.summary(1)["weight_sync_missed"] == 1.0
    finally:
        pool.close()
