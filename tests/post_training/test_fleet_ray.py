"""The rollout fleet on a real local Ray: named actors, weights through the object
store with versions, and a rollout worker SIGKILLed mid-run that Ray restarts, that
reloads the current weights, whose half-finished rollout is discarded, and the run
succeeds. Nothing is mocked but the GPU (HF generate on CPU)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.in_process_learner import GRPOLearner
from helpers.weight_board import sync_only_controller

from stages.events import InterruptionEvent
from tests.post_training.conftest import data_ref

# Above pytest's 300 s default: actor start and the blocked rollout each have one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAMESPACE = "ito-pt-test"


# Bounds on waiting (actors importing torch on a loaded machine, the blocked rollout
# and its kill); never asserted as speed.
ACTOR_TIMEOUT_S = 300.0
BLOCK_TIMEOUT_S = 180.0


def _blocking_worker(marker: Path) -> type[Any]:
    """A real RolloutWorker whose first rollout on worker 0 from version 2 on writes its
    pid to ``marker`` and blocks until the test SIGKILLs it: the kill lands inside a
    generate call by construction. The restarted actor finds the marker and does not
    block (it would carry on after BLOCK_TIMEOUT_S, failing the counts below)."""
    from stages.post_training.rollout import RolloutWorker

    class BlockingWorker(RolloutWorker):
        def generate(self, req: Any) -> Any:
            if self.spec.index == 0 and self.version >= 2 and not marker.exists():
                part = marker.with_suffix(".part")
                part.write_text(str(os.getpid()))
                part.replace(marker)  # the killer never reads a half-written pid
                deadline = time.monotonic() + BLOCK_TIMEOUT_S
                while time.monotonic() < deadline:
                    time.sleep(0.05)
            return super().generate(req)

    return BlockingWorker


def test_killed_rollout_worker_is_replaced_resynced_and_the_run_succeeds(
    ray_local: None, tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    import ray

    from stages.post_training.config import RLVRConfig
    from stages.post_training.data import load_rows
    from stages.post_training.hf_io import load_model, load_tokenizer
    from stages.post_training.pools import RayPool
    from stages.post_training.rl import RequestMaker, run_rlvr
    from stages.post_training.rollout import WorkerSpec, encode_prompts, rollout_prefix

    cfg = RLVRConfig.model_validate(
        {
            "data": data_ref(task_files["rlvr"]),
            "steps": 10,
            "reward": "first_number_match",
            "group_size": 8,
            "groups_per_step": 2,
            "max_completion_tokens": 24,
            "overlong_buffer_tokens": 4,
            "learning_rate": 1e-2,
            "max_staleness": 1,
            "rollout_workers": 2,
            "rollout_timeout_s": 120,
        }
    )
    tok = load_tokenizer(tiny_policy)
    learner = GRPOLearner(cfg, load_model(tiny_policy), tok.pad_token_id)
    specs = [
        WorkerSpec(
            index=i,
            model_dir=str(tiny_policy),
            reward=cfg.reward,
            max_completion_tokens=24,
            overlong_buffer_tokens=4,
            overlong_penalty_factor=1.0,
        )
        for i in range(2)
    ]
    marker = tmp_path / "worker-0-generating"
    pool = RayPool("pt1", specs, namespace=NAMESPACE, worker_cls=_blocking_worker(marker))
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(rollout_prefix("pt1"))
    )
    assert names == ["run-pt1-rollout-0", "run-pt1-rollout-1"]
    before = pool.identities(ACTOR_TIMEOUT_S)
    events: list[Any] = []
    killed: dict[str, Any] = {}

    def kill() -> None:
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while not marker.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        pid = int(marker.read_text())
        killed["at"], killed["pid"] = time.time(), pid
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        rows = load_rows("rlvr", cfg.data.uri)
        maker = RequestMaker(cfg, encode_prompts(tok, rows), rows)
        result, ctl = run_rlvr(
            cfg,
            learner,
            pool,
            maker,
            emit=events.append,
            on_interruption=lambda w, a, b, d: events.append(
                InterruptionEvent(
                    interruption_kind="rollout_worker_lost",
                    replica_group=w,
                    detected_at=a,
                    recovered_at=b,
                    detail=d,
                )
            ),
        )
        assert result.steps == cfg.steps and learner.version == cfg.steps
        assert killed.get("pid") == before[0]["pid"]  # killed inside worker 0's generate
        # The last weight sync reaches the restarted worker too (a death is seen at the
        # latest by the next sync, since every version goes to every worker).
        ctl.drain_syncs(ACTOR_TIMEOUT_S)
        lost = [e for e in events if isinstance(e, InterruptionEvent)]
        assert len(lost) == 1 and lost[0].replica_group == 0
        assert lost[0].recovered_at is not None and lost[0].recovered_at >= killed["at"]
        assert ctl.stats.interruptions == 1
        # The rollout the kill interrupted was thrown away (and regenerated), once.
        assert ctl.stats.discarded_rollouts == 1
        # Every trained sample stayed within eta, the refilled one included.
        assert max(ctl.stats.staleness) <= cfg.max_staleness
        after = pool.identities(ACTOR_TIMEOUT_S)
        assert after[0]["pid"] != before[0]["pid"]  # a new process ...
        assert after[1]["pid"] == before[1]["pid"]
        assert [a["version"] for a in after] == [cfg.steps, cfg.steps]  # ... re-synced
        summary = result.summary
        assert summary["rollout_interruptions"] == 1.0
        for key in (
            "rollout_samples_per_s",
            "trainer_idle_frac",
            "rollout_idle_frac",
            "weight_sync_s",
            "staleness_min",
            "staleness_mean",
            "staleness_max",
            "drop_rate",
        ):
            assert key in summary
        assert summary["rollout_samples_per_s"] > 0 and summary["weight_sync_s"] > 0
    finally:
        pool.close()


@pytest.mark.parametrize("path", ["object_store", "collective"])
def test_each_weight_path_delivers_bit_identical_weights_to_ray_actors(
    ray_local: None, tiny_policy: Path, path: str
) -> None:
    """Real Ray actors; on the collective path this process (the learner, rank 0)
    sends to the two actors over its listener, which they join with the run's key
    (an actor argument), in small buckets (several per version)."""
    import torch

    from stages.netsec import RunSecret
    from stages.post_training.hf_io import load_model
    from stages.post_training.pools import RayPool
    from stages.post_training.rollout import WorkerSpec
    from stages.post_training.weight_descriptors import state_digest
    from stages.post_training.weight_sync import sync_key

    specs = [
        WorkerSpec(
            index=i,
            model_dir=str(tiny_policy),
            reward="first_number_match",
            max_completion_tokens=4,
            overlong_buffer_tokens=2,
            overlong_penalty_factor=1.0,
        )
        for i in range(2)
    ]
    model = load_model(tiny_policy)
    pool = RayPool(
        f"ws-{path.replace('_', '-')}",
        specs,
        namespace=NAMESPACE,
        weight_sync=path,  # type: ignore[arg-type]
        bucket_bytes=16 << 10,
        sync_timeout_s=ACTOR_TIMEOUT_S,
        sync_key=sync_key(RunSecret.new()),
    )
    ctl = sync_only_controller(pool, ACTOR_TIMEOUT_S)
    try:
        pool.identities(ACTOR_TIMEOUT_S)
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            ctl.publish(version, dict(model.state_dict()))
            ctl.drain_syncs(ACTOR_TIMEOUT_S)
            want = state_digest(dict(model.state_dict()))
            assert pool.digests(ACTOR_TIMEOUT_S) == [want, want]
            assert pool.versions(ACTOR_TIMEOUT_S) == [version, version]
        assert len(ctl.stats.sync_s) == 2
        assert ctl.stats.summary(2)["sync_s_median"] > 0
    finally:
        pool.close()


def test_a_worker_ray_cannot_place_fails_the_fleet_at_start_and_is_named(
    ray_local: None, tmp_path: Path
) -> None:
    """A reservation with no room left for a worker (here its one bundle of the worker's
    CPU share is held by another actor, as the trainer's ranks hold theirs): RLVR's
    start fails with ``rollout_fleet_failed`` naming the worker and its ask, within
    ``worker_ready_timeout_s``, instead of waiting out the rollout bound."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from stages.errors import ErrorCode, ItoError
    from stages.post_training.pools import ROLLOUT_NUM_CPUS, RayPool
    from stages.post_training.rollout import WorkerSpec

    @ray.remote(num_cpus=ROLLOUT_NUM_CPUS)
    class Holder:
        def up(self) -> bool:
            return True

    pg = placement_group([{"CPU": ROLLOUT_NUM_CPUS}])
    ray.get(pg.ready(), timeout=ACTOR_TIMEOUT_S)
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    holder = Holder.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]
    assert ray.get(holder.up.remote(), timeout=ACTOR_TIMEOUT_S)
    spec = WorkerSpec(
        index=0,
        model_dir=str(tmp_path),  # never read: the worker is never placed
        reward="first_number_match",
        max_completion_tokens=4,
        overlong_buffer_tokens=1,
        overlong_penalty_factor=1.0,
    )
    pool = RayPool(
        "unplaceable", [spec], namespace=NAMESPACE, placement={"scheduling_strategy": strategy}
    )
    try:
        with pytest.raises(ItoError) as e:
            pool.wait_started(timeout_s=2.0)
        assert e.value.code is ErrorCode.rollout_fleet_failed
        assert e.value.message.startswith("rollout worker(s) [0] of 1 not started within 2s")
        assert f"each asks {ROLLOUT_NUM_CPUS} CPU of the run's reservation" in e.value.message
    finally:
        pool.close()
        ray.kill(holder)
        remove_placement_group(pg)
