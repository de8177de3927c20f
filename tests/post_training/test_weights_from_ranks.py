"""Weights reach the fleet from the learner's ranks, never through the driver.

A real RLVR objective on a real local Ray: the learner on the engine (one torchft replica
group as Ray actors, DCP), two rollout workers as Ray actors, each weight path; the
test process plays the driver (``run_rlvr_on_engine``). Every worker loads every
version with the same bytes as the other, the base folder's at 0 and the learner's
final weights (the rank's own export) at the end. What the controller hands each
worker's ``set_weights`` is recorded at the real seam (``RayPool.sync``): only
descriptors (an ``ObjectRef``, or the sender's listener and the layout) ever cross it,
never a tensor, and no weights file exists for the driver to read. Nothing is mocked
but the GPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from stages.post_training.pools import RayPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAMESPACE = "ito-pt-wsync"
# Bound on waiting for actors (importing torch on a loaded 2-core host); never speed.
ACTOR_TIMEOUT_S = 300.0


class RecordingPool(RayPool):
    """The real pool; it notes what each ``set_weights`` call carries."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.forwarded: list[tuple[int, Any]] = []

    def sync(self, w: int, version: int, weights: Any) -> Any:
        self.forwarded.append((version, weights))
        return super().sync(w, version, weights)


def _recording_worker() -> type[Any]:
    """A real RolloutWorker that also notes the digest of every version it loads."""
    from stages.post_training.rollout import RolloutWorker

    class RecordingWorker(RolloutWorker):
        def __init__(self, spec: Any, sync_key: bytes | None = None):
            super().__init__(spec, sync_key)
            self.loaded: dict[int, str] = {}

        def set_weights(self, version: int, weights: Any) -> dict[str, Any]:
            ack = super().set_weights(version, weights)
            if "missed" not in ack:
                self.loaded[version] = self.weights_digest()
            return ack

        def loaded_digests(self) -> dict[int, str]:
            return self.loaded

    return RecordingWorker


def _tensors_in(obj: Any, depth: int = 0) -> int:
    """Tensors reachable from ``obj`` through dataclass fields and containers."""
    import torch

    if isinstance(obj, torch.Tensor):
        return 1
    if depth > 6:
        return 0
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensors_in(x, depth + 1) for x in obj)
    return 0


@pytest.mark.parametrize("path", ["object_store", "collective"])
def test_the_fleet_gets_each_version_from_the_learner_rank_not_the_driver(
    ray_local: None, tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path, path: str
) -> None:
    import ray

    from stages.base import StageContext
    from stages.post_training.hf_io import load_model, load_tokenizer
    from stages.post_training.learner import run_rlvr_on_engine
    from stages.post_training.rollout import WorkerSpec
    from stages.post_training.weight_descriptors import (
        BaseWeights,
        CollectiveWeights,
        ObjectStoreWeights,
        PublishedVersion,
        state_digest,
    )
    from stages.post_training.weight_sync import sync_key
    from tests.post_training.test_fleet import _rl_setup

    steps = 2
    cfg, _, maker, _ = _rl_setup(tiny_policy, task_files, 1)
    cfg = cfg.model_copy(
        update={"steps": steps, "weight_sync": path, "weight_sync_timeout_s": ACTOR_TIMEOUT_S}
    )
    specs = [WorkerSpec.for_recipe(cfg, i, str(tiny_policy)) for i in range(2)]
    ctx = StageContext(
        run_id=f"wsync-{path}", booking_id="b", workdir=tmp_path, emit=lambda e: None
    )
    pool = RecordingPool(
        f"wsync-{path.replace('_', '-')}",
        specs,
        namespace=NAMESPACE,
        weight_sync=path,  # type: ignore[arg-type]
        sync_timeout_s=ACTOR_TIMEOUT_S,
        worker_cls=_recording_worker(),
        sync_key=sync_key(ctx.secret),  # as the stage hands the run's key to its workers
    )
    try:
        result, exported, learner, _ = run_rlvr_on_engine(
            cfg,
            ctx,
            stage="post_training",
            base=tiny_policy,
            export_dir=tmp_path / "export",
            train=None,
            device="cpu",
            pool=pool,
            maker=maker,
            pad_id=int(load_tokenizer(tiny_policy).pad_token_id),
        )
        # (a) every worker loaded every version, the same bytes as every other worker;
        # the base folder's at 0, and the learner's final weights (the rank's own
        # export of them) at the end; the versions differ (the policy trained).
        want = state_digest(dict(load_model(exported).state_dict()))
        assert pool.digests(ACTOR_TIMEOUT_S) == [want, want]
        assert pool.versions(ACTOR_TIMEOUT_S) == [steps, steps]
        loaded = ray.get([a.loaded_digests.remote() for a in pool.actors], timeout=60)
        assert loaded[0] == loaded[1] and sorted(loaded[0]) == list(range(steps + 1))
        assert loaded[0][0] == state_digest(dict(load_model(tiny_policy).state_dict()))
        assert loaded[0][steps] == want
        assert len(set(loaded[0].values())) == steps + 1
    finally:
        pool.close()
    assert result.steps == steps and result.summary["weight_sync_missed"] == 0.0
    print(f"engine rlvr, {path}: sync_s_median {result.summary['sync_s_median']:.4f} s")

    # (b) the driver never held the weights: descriptors only crossed the seam...
    by_version: dict[int, set[type]] = {}
    for version, weights in pool.forwarded:
        by_version.setdefault(version, set()).add(type(weights))
        assert _tensors_in(weights) == 0, (version, weights)
    kind = ObjectStoreWeights if path == "object_store" else CollectiveWeights
    assert by_version == {0: {BaseWeights}, **{v: {kind} for v in range(1, steps + 1)}}
    if path == "object_store":
        assert all(
            isinstance(w.ref, ray.ObjectRef) for _, w in pool.forwarded if isinstance(w, kind)
        )
    # ...what the learner took from the ranks is a descriptor, the loss a float...
    assert all(isinstance(p, PublishedVersion) for p in learner.published.values())
    assert _tensors_in(list(learner.published.values())) == 0
    assert all(isinstance(loss, float) for loss in learner.losses.values())
    # ...and no weights file exists for a driver to read.
    assert not list(tmp_path.rglob("v*.pt")) and not (tmp_path / "rlvr" / "weights").exists()
