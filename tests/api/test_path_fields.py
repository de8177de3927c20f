"""Every path a manifest names stays in the tenant's roots, at plan and at run time.

Each test is an attack that worked on the old code: another tenant's Hugging Face
folder named as ``model.checkpoint_path``, ``model.tokenizer_path`` or (through a
symlink-filled folder) ``post_training.base_model``; a data file swapped for a symlink
after data prep checked its digest. Real SQLite, real gates, real files and symlinks;
the two-tenant world is tests/api/test_isolation.py's.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from orchestrator.gates.manifest import Manifest
from stages.base import StageContext, StrictModel
from stages.data_prep import DataPrepStage
from stages.data_prep.config import DataPrepConfig
from stages.pathfields import field_spec
from stages.snapshot import path_digest
from stages.trainer.config import TrainStageConfig
from stages.trainer.stage import TrainingStage
from tests.api import test_isolation
from tests.api.test_isolation import World, _leaks

world = test_isolation.world  # the two-tenant fixture

# A field whose name says "path" must carry a PathField marker; the few names that
# look like paths but are not say why here.
PATH_LIKE = re.compile(r"(path|paths|dir|dirs|uri|uris|file|files|folder|root|roots|model)$")
NOT_PATHS: dict[str, str] = {}


def _models(annotation: Any) -> typing.Iterator[type[BaseModel]]:
    if typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            yield from _models(arg)
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation


def unmarked_path_fields(root: type[BaseModel]) -> list[str]:
    """Path-like fields anywhere below ``root`` that no PathField marks."""
    found, seen, stack = [], set(), [(root, "")]
    while stack:
        model, prefix = stack.pop()
        for name, info in model.model_fields.items():
            where = f"{prefix}{name}"
            subs = list(_models(info.annotation))  # a section, not a value
            if (
                PATH_LIKE.search(name)
                and not subs
                and field_spec(model, name) is None
                and where not in NOT_PATHS
            ):
                found.append(where)
            for sub in subs:
                if sub not in seen:
                    seen.add(sub)
                    stack.append((sub, f"{where}."))
    return sorted(found)


def test_every_path_like_field_of_the_manifest_is_marked_and_checked() -> None:
    assert unmarked_path_fields(Manifest) == []

    class Later(StrictModel):  # a field added tomorrow without the marker
        name: str = "x"
        extra_dir: str | None = None

    class Grown(Manifest):
        later: Later = Later()

    assert unmarked_path_fields(Grown) == ["later.extra_dir"]


# --- the attacks ----------------------------------------------------------------------
def _hf_folder(folder: Path, weights: bytes = b"globex weights") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _globex_model(w: World) -> Path:
    return _hf_folder(w.tmp / "globex-data" / "model")


def _pt_manifest(w: World, **post: Any) -> dict[str, Any]:
    sft = w.data_root / "sft.jsonl"
    sft.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
        )
        + "\n"
    )
    m = w.manifest(f"file://{w.data_root}/train.jsonl")
    m["post_training"] = {
        "sft": {
            "data": {
                "uri": f"file://{sft}",
                "sha256": hashlib.sha256(sft.read_bytes()).hexdigest(),
                "provenance": {"source": "s", "license": "MIT"},
            },
            "steps": 1,
        },
        **post,
    }
    return m


def _with(w: World, field: str, value: str) -> dict[str, Any]:
    if field == "post_training.base_model":
        return _pt_manifest(w, base_model=value, base_model_sha256="1" * 64)
    m = w.manifest(f"file://{w.data_root}/train.jsonl")
    m["model"][field.split(".")[1]] = value
    return m


def _pairs(w: World, globex: Path) -> dict[str, tuple[str, str]]:
    """Per trick, (a target that exists, one that does not): the answers must match."""
    missing = globex.parent / "no-such-model"
    (w.data_root / "steal").symlink_to(globex)
    (w.data_root / "steal-missing").symlink_to(missing)
    for name, target in (("filled", globex), ("filled-missing", missing)):
        folder = w.data_root / name  # a folder of the tenant's own, weights symlinked
        folder.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (folder / f).write_text("{}")
        (folder / "model.safetensors").symlink_to(target / "model.safetensors")
    return {
        "absolute": (str(globex), str(missing)),
        "file_uri": (f"file://{globex}", f"file://{missing}"),
        "symlink": (str(w.data_root / "steal"), str(w.data_root / "steal-missing")),
        "symlink_filled": (str(w.data_root / "filled"), str(w.data_root / "filled-missing")),
        "dotdot": (
            f"{w.data_root}/../globex-data/model",
            f"{w.data_root}/../globex-data/no-such-model",
        ),
    }


FIELDS = ("model.checkpoint_path", "model.tokenizer_path", "post_training.base_model")


@pytest.mark.parametrize("field", FIELDS)
def test_another_tenants_model_folder_is_refused_at_plan_alike_whether_it_exists(
    world: World, field: str
) -> None:
    w = world
    globex = _globex_model(w)
    for trick, (there, absent) in _pairs(w, globex).items():
        answers = []
        for value in (there, absent):
            r = w.plan(_with(w, field, value))
            assert r.status_code == 422, (trick, value, r.text)
            assert r.json()["error"]["code"] == "path_outside_root", (trick, value, r.text)
            assert not _leaks(r.text, globex, w.tmp / "globex-data"), (trick, r.text)
            answers.append(r.json()["error"])
        assert answers[0] == answers[1], trick  # existence is not told
    # A hub id or a relative path is never resolved (nor fetched): its own clear code.
    for value in ("meta-llama/Llama-3.2-1B", "hf://meta-llama/Llama-3.2-1B", "acme-tok"):
        r = w.plan(_with(w, field, value))
        assert r.json()["error"]["code"] == "path_not_local", (value, r.text)
        assert value not in r.json()["error"]["message"]
    # The tenant's own folder is fine.
    own = _hf_folder(w.data_root / "own")
    m = _with(w, field, str(own))
    if field == "post_training.base_model":
        m["post_training"]["base_model_sha256"] = path_digest(own)
    r = w.plan(m)
    assert r.status_code == 200, r.text


def test_a_placeholder_post_training_digest_is_refused_at_plan(world: World) -> None:
    m = _pt_manifest(world)
    m["post_training"]["sft"]["data"]["sha256"] = "0" * 64
    r = world.plan(m)
    assert r.json()["error"]["code"] == "data_digest_placeholder", r.text


def _train_stage(w: World, **model: str) -> TrainingStage:
    m = w.manifest(f"file://{w.data_root}/train.jsonl")
    m["model"].update(model)
    mf = Manifest.model_validate(m)
    cfg = TrainStageConfig(model=mf.model, target=mf.training, checkpoint=mf.checkpoint)
    return TrainingStage(cfg, model_roots=(str(w.data_root), str(w.ckpt_root)))


@pytest.mark.parametrize("name", ["checkpoint_path", "tokenizer_path"])
def test_the_training_stage_checks_again_and_loads_only_a_private_copy(
    world: World, tmp_path: Path, name: str
) -> None:
    """Passed at plan, swapped afterwards: the run walks again with roots from the
    supervisor, answers alike whether the target exists, and every rank loads a copy
    made from the descriptors it checked."""
    w = world
    globex = _globex_model(w)
    own = _hf_folder(w.data_root / "own", weights=b"acme weights")
    assert w.plan(_with(w, f"model.{name}", str(own))).status_code == 200
    pinned = _train_stage(w, **{name: str(own)}).pin_inputs(
        StageContext(run_id="r1", booking_id="b", workdir=tmp_path / "ok")
    )
    copy = Path(getattr(pinned.model, name))
    assert copy.is_relative_to(tmp_path / "ok") and path_digest(copy) == path_digest(own)
    answers = []
    for trick, (there, absent) in _pairs(w, globex).items():
        for value in (there, absent):
            out = _train_stage(w, **{name: value}).run(
                StageContext(run_id="r1", booking_id="b", workdir=tmp_path / trick)
            )
            assert out.status == "failed" and out.error_code == "path_outside_root", (
                trick,
                value,
                out,
            )
            assert not _leaks(out.reason, globex, w.tmp / "globex-data"), out.reason
            answers.append(out.reason)
    assert len(set(answers)) == 1
    # After the check: the tenant's folder now points at globex's; the copy the ranks
    # load still holds the tenant's bytes.
    (own / "model.safetensors").unlink()
    (own / "model.safetensors").symlink_to(globex / "model.safetensors")
    assert (copy / "model.safetensors").read_bytes() == b"acme weights"


def test_the_post_training_stage_refuses_a_symlink_filled_base_model_at_run(
    world: World, tmp_path: Path
) -> None:
    from stages.post_training import PostTrainingStage, PostTrainingStageConfig

    w = world
    globex = _globex_model(w)
    pairs = _pairs(w, globex)
    answers = []
    for trick in ("symlink", "symlink_filled", "absolute"):
        for value in pairs[trick]:
            recipe = Manifest.model_validate(
                _pt_manifest(w, base_model=value, base_model_sha256="1" * 64)
            ).post_training
            stage = PostTrainingStage(
                PostTrainingStageConfig(
                    recipe=recipe,
                    output_dir=str(tmp_path / "out"),
                    fleet="local",
                    data_roots=(str(w.data_root),),
                    model_roots=(str(w.data_root),),
                )
            )
            out = stage.run(StageContext(run_id="r1", booking_id="b", workdir=tmp_path / "w"))
            assert out.error_code == "path_outside_root", (trick, value, out)
            answers.append(out.reason)
    assert len(set(answers)) == 1 and not _leaks(answers[0], globex)
    assert not (tmp_path / "out").exists()  # nothing trained, nothing saved


def test_a_data_file_swapped_for_a_symlink_during_data_prep_is_not_read(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the digests are checked and before the streaming engine reads, the ref is
    swapped for a symlink to another tenant's corpus: the run reads what it checked."""
    import stages.data_prep.stage as stage_mod

    w = world
    globex = w.tmp / "globex-data" / "corpus.jsonl"
    globex.parent.mkdir(parents=True)
    globex.write_text(
        "".join(json.dumps({"text": f"globex private document {i} " * 4}) + "\n" for i in range(20))
    )
    ref = w.data_root / "train.jsonl"
    ref.write_text(
        "".join(json.dumps({"text": f"acme document number {i} " * 4}) + "\n" for i in range(20))
    )
    m = w.manifest(f"file://{ref}", eval_suites=[])
    m["data"]["refs"][0]["sha256"] = hashlib.sha256(ref.read_bytes()).hexdigest()
    m["data"]["ladder_probe"] = {"enabled": False}
    real = stage_mod.run_stream

    def swap_then_stream(*args: Any, **kw: Any) -> Any:
        ref.unlink()
        ref.symlink_to(globex)  # the digest check is done; the engine reads next
        return real(*args, **kw)

    monkeypatch.setattr(stage_mod, "run_stream", swap_then_stream)
    ctx = StageContext(run_id="r1", booking_id="b", workdir=tmp_path)
    out = DataPrepStage(
        DataPrepConfig.model_validate(m["data"]), data_roots=(str(w.data_root),)
    ).run(ctx)
    assert ref.is_symlink()  # the swap happened
    assert out.status == "passed", out
    cleaned = "".join(Path(p).read_text() for p in out.artifacts["train_files"]["custom"])
    assert "acme document number 7" in cleaned
    assert "globex" not in cleaned
    assert not (tmp_path / "data_prep" / "inputs").exists()  # the private copies are gone
    again = DataPrepStage(
        DataPrepConfig.model_validate(m["data"]), data_roots=(str(w.data_root),)
    ).run(StageContext(run_id="r2", booking_id="b", workdir=tmp_path / "again"))
    assert again.error_code == "path_outside_root"


def test_a_remote_ref_from_the_tenants_cache_folder_is_walked_too(
    world: World, tmp_path: Path
) -> None:
    """An hf:// ref resolves from the tenant's ``cache_dir``; a symlink there to another
    tenant's corpus is refused like any other, and a real copy is read privately."""
    w = world
    globex = w.tmp / "globex-data" / "corpus.jsonl"
    globex.parent.mkdir(parents=True)
    globex.write_text(json.dumps({"text": "globex private"}) + "\n")
    cache = w.data_root / "cache"
    (cache / "hf" / "datasets" / "acme").mkdir(parents=True)
    cached = cache / "hf" / "datasets" / "acme" / "ds.jsonl"
    cached.symlink_to(globex)
    m = w.manifest("hf://datasets/acme/ds.jsonl", eval_suites=[], cache_dir=str(cache))
    m["data"]["refs"][0]["sha256"] = hashlib.sha256(globex.read_bytes()).hexdigest()
    m["data"]["ladder_probe"] = {"enabled": False}

    def run(name: str) -> Any:
        return DataPrepStage(
            DataPrepConfig.model_validate(m["data"]), data_roots=(str(w.data_root),)
        ).run(StageContext(run_id="r1", booking_id="b", workdir=tmp_path / name))

    out = run("link")
    assert out.error_code == "path_outside_root", out
    assert not _leaks(out.reason, globex)
    cached.unlink()
    cached.write_text(json.dumps({"text": "acme cached document"}) + "\n")
    m["data"]["refs"][0]["sha256"] = hashlib.sha256(cached.read_bytes()).hexdigest()
    assert run("real").status == "passed"
