"""The rollout fleet on a real local Ray: named actors, weights through the object
store with versions, and a rollout worker SIGKILLed mid-run that Ray restarts, that
reloads the current weights, whose half-finished rollout is discarded, and the run
succeeds. Nothing is mocked but the GPU (HF generate on CPU)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages.events import InterruptionEvent, MetricsEvent
from tests.post_training.conftest import data_ref

pytestmark = pytest.mark.slow
NAMESPACE = "ito-pt-test"


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    tmp = tempfile.mkdtemp(prefix="ray-pt-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp,
             log_to_driver=False, namespace=NAMESPACE)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def test_killed_rollout_worker_is_replaced_resynced_and_the_run_succeeds(
        ray_local: None, tiny_policy: Path, task_files: dict[str, Path]) -> None:
    import ray

    from stages.post_training.config import RLVRConfig
    from stages.post_training.data import load_rows
    from stages.post_training.hf_io import load_model, load_tokenizer
    from stages.post_training.pools import RayPool
    from stages.post_training.rl import GRPOLearner, RequestMaker, run_rlvr
    from stages.post_training.rollout import WorkerSpec, rollout_prefix

    cfg = RLVRConfig.model_validate({
        "data": data_ref(task_files["rlvr"]), "steps": 10, "reward": "first_number_match",
        "group_size": 8, "groups_per_step": 2, "max_completion_tokens": 24,
        "overlong_buffer_tokens": 4, "learning_rate": 1e-2, "max_staleness": 1,
        "rollout_workers": 2, "rollout_timeout_s": 120})
    tok = load_tokenizer(tiny_policy)
    learner = GRPOLearner(cfg, load_model(tiny_policy), tok.pad_token_id)
    specs = [WorkerSpec(index=i, model_dir=str(tiny_policy), reward=cfg.reward,
                        max_completion_tokens=24, overlong_buffer_tokens=4,
                        overlong_penalty_factor=1.0) for i in range(2)]
    pool = RayPool("pt1", specs, namespace=NAMESPACE)
    names = sorted(n for n in ray.util.list_named_actors() if str(n).startswith(
        rollout_prefix("pt1")))
    assert names == ["run-pt1-rollout-0", "run-pt1-rollout-1"]
    before = pool.identities(60)
    events: list[Any] = []
    killed: dict[str, Any] = {}

    def emit(ev: Any) -> None:
        events.append(ev)
        if isinstance(ev, MetricsEvent) and ev.step == 2 and not killed:
            threading.Thread(target=kill, daemon=True).start()

    def kill() -> None:
        time.sleep(0.05)  # the workers are generating for step 3 by now (eta = 1)
        pid = before[0]["pid"]
        killed["at"] = time.time()
        os.kill(pid, signal.SIGKILL)

    try:
        result, ctl = run_rlvr(cfg, learner, pool, RequestMaker(cfg, tok,
                                                                load_rows("rlvr", cfg.data.uri)),
                               emit=emit, on_interruption=lambda w, a, b, d: events.append(
                                   InterruptionEvent(interruption_kind="rollout_worker_lost",
                                                     replica_group=w, detected_at=a,
                                                     recovered_at=b, detail=d)))
        assert result.steps == cfg.steps and learner.version == cfg.steps
        assert "at" in killed
        # The last weight sync reaches the restarted worker too (a death is seen at the
        # latest by the next sync, since every version goes to every worker).
        ctl.drain_syncs(60)
        lost = [e for e in events if isinstance(e, InterruptionEvent)]
        assert len(lost) == 1 and lost[0].replica_group == 0
        assert lost[0].recovered_at is not None and lost[0].recovered_at >= killed["at"]
        assert ctl.stats.interruptions == 1
        # Every trained sample stayed within eta, the refilled one included.
        assert max(ctl.stats.staleness) <= cfg.max_staleness
        after = pool.identities(60)
        assert after[0]["pid"] != before[0]["pid"]          # a new process ...
        assert after[1]["pid"] == before[1]["pid"]
        assert [a["version"] for a in after] == [cfg.steps, cfg.steps]  # ... re-synced
        summary = result.summary
        assert summary["rollout_interruptions"] == 1.0
        for key in ("rollout_samples_per_s", "trainer_idle_frac", "rollout_idle_frac",
                    "weight_sync_s", "staleness_min", "staleness_mean", "staleness_max",
                    "drop_rate"):
            assert key in summary
        assert summary["rollout_samples_per_s"] > 0 and summary["weight_sync_s"] > 0
    finally:
        pool.close()
