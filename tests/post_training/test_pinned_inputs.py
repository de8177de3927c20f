"""Post-training trains only on the bytes the manifest's digests name.

The attack: a dataset or the base model is changed after submit (the manifest, and
its digests, were reviewed and accepted). The run reads each input once, by the safe
walk, hashes what it read and compares before any objective trains: a change is
``data_digest_mismatch`` and nothing of it is trained on. Real files, the real stage
(local rollout fleet), a tiny random-init policy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from helpers.tenants import DEFAULT_ROOTS

from stages.base import StageContext
from stages.events import Event, MetricsEvent
from stages.post_training import PostTrainingStage, PostTrainingStageConfig
from tests.post_training.conftest import base_model, data_ref


def _stage(tmp: Path, policy: Path, sft: Path) -> PostTrainingStage:
    recipe: dict[str, Any] = {
        **base_model(policy),
        "sft": {"data": data_ref(sft), "steps": 2, "gate": None},
    }
    return PostTrainingStage(
        PostTrainingStageConfig.model_validate(
            {
                "recipe": recipe,
                "output_dir": str(tmp / "out"),
                "fleet": "local",
                "data_roots": DEFAULT_ROOTS,
                "model_roots": DEFAULT_ROOTS,
            }
        )
    )


def _run(stage: PostTrainingStage, tmp: Path) -> tuple[Any, list[Event]]:
    events: list[Event] = []
    out = stage.run(
        StageContext(run_id="r1", booking_id="b", workdir=tmp / "w", emit=events.append)
    )
    return out, events


def test_a_dataset_changed_after_submit_fails_the_run_untrained(
    tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    sft = tmp_path / "sft.jsonl"
    shutil.copy(task_files["sft"], sft)
    stage = _stage(tmp_path, tiny_policy, sft)  # the digests the manifest was accepted with
    with sft.open("a") as f:  # after submit: one more, unreviewed conversation
        f.write(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "exfiltrate"},
                        {"role": "assistant", "content": "ok"},
                    ]
                }
            )
            + "\n"
        )
    out, events = _run(stage, tmp_path)
    assert out.status == "failed" and out.error_code == "data_digest_mismatch", out
    assert "post_training.sft.data" in out.reason and str(sft) not in out.reason
    assert not any(isinstance(e, MetricsEvent) for e in events)  # no objective ran
    assert not (tmp_path / "out").exists()  # nothing trained, nothing saved


def test_a_base_model_changed_after_submit_fails_the_run_untrained(
    tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy, policy)
    stage = _stage(tmp_path, policy, task_files["sft"])
    weights = next(policy.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte in the weights
    weights.write_bytes(bytes(raw))
    out, events = _run(stage, tmp_path)
    assert out.status == "failed" and out.error_code == "data_digest_mismatch", out
    assert not any(isinstance(e, MetricsEvent) for e in events)
    assert not (tmp_path / "out").exists()


def test_unchanged_inputs_train_from_a_private_copy(
    ray_local: None, tmp_path: Path, tiny_policy: Path, task_files: dict[str, Path]
) -> None:
    out, _ = _run(_stage(tmp_path, tiny_policy, task_files["sft"]), tmp_path)
    assert out.status == "passed", out
    copy = tmp_path / "w" / "inputs" / "base_model"
    assert (copy / "config.json").read_bytes() == (tiny_policy / "config.json").read_bytes()
