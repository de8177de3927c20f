"""A phase's eval battery and HF export, run on trainer ranks while the fleet waits at
the phase's end (never in the driver).

The battery is cut into units (``PhaseEvalRequest.units``): each lm-eval task, and
the held-out windows in shares. The engine hands them to rank 0 of every live replica
group, the next unit to whichever is free (``run_unit``), so a group done with a
generation task scores held-out shares while another still generates; it adds the
held-out sums up (``stages.evals.heldout``), and rank 0 of the lowest live group
assembles the battery from the units' results and completes the export
(``evaluate_on_rank``). A single-rank group holds the whole live model: the units run
on it directly (it is bit-identical to the closing checkpoint: nothing updated it
since the save). A rank whose model is laid out over several ranks (FSDP2, TP, PP),
recomputes activations or runs fp8 linears loads the closing checkpoint into a fresh,
plain model in its own process instead (``load_phase_model``, once a phase end).
Either way the scores are those of the closing checkpoint, and the driver only sees
numbers and paths.

The HF export is always streamed from the closing checkpoint, a safetensors shard at
a time: every live rank writes its share of the shards into the export's staging
folder (``export_share``, every n-th shard), and the evaluating rank completes and
renames it (``export_phase``: index, config, tokenizer, each file's writer in
``ito_export.json``). A phase without a battery (a post-training objective with
no scoring) builds no model at all.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, JsonValue

from stages.checkpointing.seal import CheckpointBinding
from stages.curriculum.schedule import PhaseSpan
from stages.errors import ErrorCode, ItoError
from stages.evals.battery import CheckResult
from stages.evals.config import EvalRunSettings
from stages.evals.heldout import HeldoutSums
from stages.evals.objective_eval import (
    ObjectiveEvalReply,
    ObjectiveEvalRequest,
    evaluate_objective,
)
from stages.trainer.config import TrainStageConfig

if TYPE_CHECKING:  # the driver builds requests here; the ranks import torch
    from collections.abc import Callable

    import torch
    from ray import ObjectRef
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from stages.checkpointing.sealed import SealedCheckpoint
    from stages.model.llama import Llama


class PhaseEvalRequest(BaseModel):
    """What the driver asks the evaluating rank to do at a phase's end."""

    phase: PhaseSpan
    checkpoint: str
    step: int
    # The run the closing checkpoint must be sealed for (with ``phase`` and ``step``).
    run: CheckpointBinding = CheckpointBinding()
    heldout_path: str
    tokenizer_dir: str
    work_dir: str
    export_dir: str
    metadata: dict[str, JsonValue]
    settings: EvalRunSettings
    # A post-training objective: its gate metrics and battery, scored here too.
    post_training: ObjectiveEvalRequest | None = None
    # The held-out shares the live groups scored (``run_unit``), reduced; None: the
    # battery has no held-out check (or the evaluating rank scores the whole split).
    heldout_sums: HeldoutSums | None = None
    # The lm-eval checks the live groups ran (``run_unit``); None: the evaluating rank
    # runs them.
    task_checks: list[CheckResult] | None = None
    # The export's staging folder, agreed by every rank that writes shards into it
    # (``export_share``), and which rank wrote each file; None: the evaluating rank
    # writes every shard itself.
    export_token: str | None = None
    export_writers: dict[str, str] | None = None

    def units(self, groups: int) -> list[EvalUnit]:
        """The battery's units for ``groups`` live groups, the longest first: each
        lm-eval task, then the held-out batches in ``HELDOUT_SHARES_PER_GROUP`` shares
        a group (fine enough that the groups finish together), at most one a batch."""
        from stages.evals.battery import lm_eval_tasks
        from stages.evals.config import load_battery

        if self.phase.eval_battery is None:
            return []
        battery = load_battery(self.phase.eval_battery)
        units = [EvalUnit(task=task) for task in lm_eval_tasks(battery)]
        if any(c.kind == "heldout" for c in battery.checks):
            # Never more shares than the split can have batches (a long window may make
            # it one batch, whatever the fleet's size).
            s = self.settings
            windows = s.heldout_max_tokens // (s.heldout_seq_len or self.phase.seq_len)
            parts = min(HELDOUT_SHARES_PER_GROUP * groups, max(1, -(-windows // s.batch_size)))
            units += [EvalUnit(part=part, parts=parts) for part in range(parts)]
        return units

    def heldout_texts(self) -> list[str]:
        return [
            json.loads(line)["text"]
            for line in Path(self.heldout_path).read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]


# Held-out shares per live group: a group that finished its lm-eval task takes the
# shares the others have not started, so the groups end within about one share.
HELDOUT_SHARES_PER_GROUP = 4


class EvalUnit(BaseModel):
    """One unit of a phase's battery that any live group's rank 0 runs: an lm-eval
    task (all its checks), or every ``parts``-th held-out batch from the ``part``-th."""

    task: str | None = None
    part: int = 0
    parts: int = 1


class EvalUnitReply(BaseModel):
    checks: list[CheckResult] = []
    heldout: HeldoutSums | None = None


class PhaseEvalReply(BaseModel):
    result: dict[str, JsonValue]  # a BatteryResult, as JSON; empty: the phase has no battery
    export: str
    live_model: bool
    post_training: ObjectiveEvalReply | None = None


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The run's tokenizer, loaded once per rank (each unit of a phase end needs it)."""
    from stages.hf import load_tokenizer

    return load_tokenizer(path)


def battery_runs_lm_eval(name: str | None) -> bool:
    """Whether the battery ``name`` has an lm-evaluation-harness task (a held-out-only
    battery needs neither lm-eval's import nor its task files)."""
    from stages.evals.battery import lm_eval_tasks
    from stages.evals.config import load_battery

    return name is not None and bool(lm_eval_tasks(load_battery(name)))


def warm_phase_end(cfg: TrainStageConfig, *, tasks: bool) -> None:
    """Import what this rank runs at a phase's end ahead of the first one: the HF
    export (safetensors, the tokenizer, the model's transformers class: every live rank
    writes export shards, and each group's rank 0 scores held-out windows) and, with
    ``tasks``, lm-evaluation-harness (``stages.evals.harness.preload``). Done at the
    first phase's end, each import stalls the whole fleet (~1 s for the export's on a
    loaded host)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    import stages.hf.export  # noqa: F401

    # Imports the class's module only: building a model would set process-wide state
    # (torch's default dtype) under the rank's own model building (proxies, hand-overs).
    MODEL_FOR_CAUSAL_LM_MAPPING[type(_export_config(cfg, rope_theta=None))]
    if tasks:
        from stages.evals.harness import preload

        preload()


def sealed_checkpoint(path: str, run: CheckpointBinding, phase: str) -> SealedCheckpoint:
    """The checkpoint at ``path``, its seal, binding (``run``, ``phase``, the step its
    folder names) and metadata checked: one per checkpoint and process, so the export
    share, the units and the battery of a phase end check its seal once and each data
    file once, when first read. A checkpoint saved again under the same name (an
    approved restart) has a new seal, and so is checked anew."""
    from stages.checkpointing.seal import SEAL_NAME

    try:
        st = os.stat(Path(path) / SEAL_NAME, follow_symlinks=False)
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        version = (0, 0, 0)  # SealedCheckpoint refuses it with its code
    return _sealed_checkpoint(path, run.run_id, run.account, phase, version)


@functools.lru_cache(maxsize=2)
def _sealed_checkpoint(
    path: str, run_id: str, account: str, phase: str, _version: tuple[int, int, int]
) -> SealedCheckpoint:
    from stages.checkpointing.seal import seal_key
    from stages.checkpointing.sealed import SealedCheckpoint

    run = CheckpointBinding(run_id=run_id, account=account)
    return SealedCheckpoint(Path(path), seal_key(), run, phase=phase)


def closing_checkpoint(req: PhaseEvalRequest) -> SealedCheckpoint:
    """The phase's closing checkpoint, as ``sealed_checkpoint`` checks it."""
    return sealed_checkpoint(req.checkpoint, req.run, req.phase.name)


def load_phase_model(cfg: TrainStageConfig, phase: PhaseSpan, sealed: SealedCheckpoint) -> Llama:
    """The weights of a sealed checkpoint (``sealed_checkpoint``) in a fresh model of the
    phase's shape."""
    from stages.model.lm import build_model, set_rope_theta
    from stages.presets import load_model_preset

    model = build_model(
        load_model_preset(cfg.model.preset),
        seed=cfg.target.seed,
        checkpoint_path=cfg.model.checkpoint_path,
    )
    if phase.rope_theta is not None:
        set_rope_theta(model, phase.rope_theta)
    sd = model.state_dict()
    try:
        sealed.load({"train": {"model": sd}})
    except ItoError:
        raise
    except Exception as e:
        raise ItoError(
            ErrorCode.checkpoint_corrupt,
            f"phase {phase.name}: checkpoint {sealed.path.name} could not "
            f"be loaded for evaluation: {type(e).__name__}",
        ) from e
    model.load_state_dict(sd)
    model.eval()
    return model


def _export_config(cfg: TrainStageConfig, *, rope_theta: float | None) -> PretrainedConfig:
    """The transformers config a phase's export is written with (its RoPE base)."""
    from stages.model.lm import model_config, set_config_rope_theta
    from stages.presets import load_model_preset

    config = model_config(
        load_model_preset(cfg.model.preset), checkpoint_path=cfg.model.checkpoint_path
    )
    if rope_theta is not None:
        set_config_rope_theta(config, rope_theta)
    return config


def export_share(
    req: PhaseEvalRequest, cfg: TrainStageConfig, *, part: int, parts: int, writer: str
) -> dict[str, str]:
    """This rank's share of the phase's HF export: every ``parts``-th safetensors shard
    from the ``part``-th, streamed from the closing checkpoint into the export's
    staging folder; returns {file: ``writer``}."""
    from stages.hf.export import export_shards, staging_dir

    if req.export_token is None:
        raise ItoError(ErrorCode.invalid_state, "an export share needs the export's token")
    files = export_shards(
        closing_checkpoint(req),
        _export_config(cfg, rope_theta=req.phase.rope_theta),
        staging_dir(req.export_dir, req.export_token),
        part=part,
        parts=parts,
        shard_bytes=req.settings.export_shard_bytes,
    )
    return dict.fromkeys(files, writer)


def export_phase(
    req: PhaseEvalRequest,
    cfg: TrainStageConfig,
    tokenizer: PreTrainedTokenizerBase,
    sealed: SealedCheckpoint,
) -> Path:
    """The phase's HF export, from its closing checkpoint (the same weights whether this
    rank's model is live or laid out over several ranks): the shards the live ranks
    staged (``export_share``), completed here, or, without a token, every shard
    written here."""
    from stages.hf.export import export_hf_from_checkpoint, finish_export, staging_dir

    config = _export_config(cfg, rope_theta=req.phase.rope_theta)
    shard_bytes = req.settings.export_shard_bytes
    if req.export_token is None:
        return export_hf_from_checkpoint(
            sealed,
            config,
            tokenizer,
            Path(req.export_dir),
            metadata=req.metadata,
            shard_bytes=shard_bytes,
        )
    return finish_export(
        sealed,
        config,
        tokenizer,
        staging_dir(req.export_dir, req.export_token),
        Path(req.export_dir),
        metadata={**req.metadata, "written_by": req.export_writers or {}},
        shard_bytes=shard_bytes,
    )


def evaluate_on_rank(
    req: PhaseEvalRequest,
    *,
    cfg: TrainStageConfig,
    model: Callable[[], torch.nn.Module],
    live: bool,
) -> PhaseEvalReply:
    """Assemble the phase's battery (a phase without one, e.g. a post-training
    objective, is only exported: ``result`` is empty) from the units' results in
    ``req`` (what they left out runs here), score a post-training objective, and write
    the HF export; ``model`` gives the model the checks score (``live``: this rank's
    own, see the module docstring)."""
    from stages.evals import run_battery

    tokenizer = _tokenizer(req.tokenizer_dir)
    sealed = closing_checkpoint(req)
    result: dict[str, JsonValue] = {}
    scored: ObjectiveEvalReply | None = None
    if req.phase.eval_battery is None and req.post_training is None:
        export = export_phase(req, cfg, tokenizer, sealed)
        return PhaseEvalReply(result=result, export=str(export), live_model=False)
    scoring = model()
    was_training = scoring.training
    try:
        if req.phase.eval_battery is not None:
            result = run_battery(
                scoring,
                tokenizer,
                req.phase.eval_battery,
                req.heldout_texts() if req.heldout_sums is None else [],
                seq_len=req.phase.seq_len,
                phase=req.phase.name,
                step=req.step,
                settings=req.settings,
                work_dir=Path(req.work_dir),
                heldout_sums=req.heldout_sums,
                task_checks=req.task_checks,
            ).model_dump(mode="json")
        export = export_phase(req, cfg, tokenizer, sealed)
        if req.post_training is not None:
            scored = evaluate_objective(
                req.post_training,
                scoring,
                tokenizer,
                settings=req.settings,
                work_dir=Path(req.work_dir),
            )
    finally:
        scoring.train(was_training)
    return PhaseEvalReply(result=result, export=str(export), live_model=live, post_training=scored)


def run_unit(
    req: PhaseEvalRequest, unit: EvalUnit, *, model: Callable[[], torch.nn.Module]
) -> EvalUnitReply:
    """One unit of the phase's battery on this rank (``PhaseEvalRequest.units``)."""
    from stages.evals.battery import lm_eval_tasks, run_task_checks
    from stages.evals.config import load_battery
    from stages.evals.heldout import heldout_sums

    if req.phase.eval_battery is None:
        raise ItoError(ErrorCode.invalid_state, f"phase {req.phase.name} has no battery")
    tokenizer = _tokenizer(req.tokenizer_dir)
    s = req.settings
    if unit.task is not None:
        checks = lm_eval_tasks(load_battery(req.phase.eval_battery)).get(unit.task)
        if checks is None:
            raise ItoError(ErrorCode.invalid_state, f"no task {unit.task} in the battery")
        return EvalUnitReply(
            checks=run_task_checks(
                model(), tokenizer, unit.task, checks, settings=s, work_dir=Path(req.work_dir)
            )
        )
    return EvalUnitReply(
        heldout=heldout_sums(
            model(),
            tokenizer,
            req.heldout_texts(),
            seq_len=s.heldout_seq_len or req.phase.seq_len,
            max_tokens=s.heldout_max_tokens,
            batch_size=s.batch_size,
            part=unit.part,
            parts=unit.parts,
        )
    )


# --- the driver's side ----------------------------------------------------------------
def evaluate_phase_end(
    actors: dict[tuple[int, int], Any],
    live: list[int],
    request: dict[str, JsonValue],
    timeout_s: float,
) -> dict[str, JsonValue]:
    """A phase's battery and export on the ranks (``actors`` by (group, rank)) waiting
    at its end: the export's shards over every rank of the ``live`` groups, the
    battery's units over rank 0 of each, the next unit to whichever is free, the
    held-out sums reduced here; then rank 0 of the lowest live group assembles the
    battery and completes the export. Returns ``PhaseEvalReply`` as JSON."""
    import ray

    from stages.evals.heldout import reduce_sums

    deadline = time.monotonic() + timeout_s
    req = PhaseEvalRequest.model_validate(request)
    ranks = sorted(k for k in actors if k[0] in live)
    request = {**request, "export_token": uuid.uuid4().hex[:12]}
    # Each rank writes its export shares before it takes a unit (an actor runs its
    # calls in order).
    exports = [
        actors[k].export_share.remote(request, part, len(ranks)) for part, k in enumerate(ranks)
    ]
    units = _run_units(actors, request, req.units(len(live)), [(g, 0) for g in live], deadline)
    writers: dict[str, JsonValue] = {}  # export file -> the rank that wrote it
    for files in ray.get(exports, timeout=_left(deadline)):
        writers.update(files)
    request = {**request, "export_writers": writers}
    held = [u.heldout for u in units if u.heldout is not None]
    if held:
        request["heldout_sums"] = reduce_sums(held).model_dump(mode="json")
    if any(u.checks for u in units):
        request["task_checks"] = [c.model_dump(mode="json") for u in units for c in u.checks]
    reply: dict[str, JsonValue] = ray.get(
        actors[(live[0], 0)].evaluate_phase.remote(request), timeout=_left(deadline)
    )
    return reply


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _run_units(
    actors: dict[tuple[int, int], Any],
    request: dict[str, JsonValue],
    units: list[EvalUnit],
    workers: list[tuple[int, int]],
    deadline: float,
) -> list[EvalUnitReply]:
    """Each unit on the next free worker, in the units' order (the longest first)."""
    import ray
    from ray.exceptions import GetTimeoutError

    queue, free = list(units), list(workers)
    running: dict[ObjectRef[dict[str, JsonValue]], tuple[int, int]] = {}
    replies: list[EvalUnitReply] = []
    while queue or running:
        while queue and free:
            key = free.pop(0)
            unit = queue.pop(0).model_dump(mode="json")
            running[actors[key].eval_unit.remote(request, unit)] = key
        ready, _ = ray.wait(list(running), num_returns=1, timeout=_left(deadline))
        if not ready:
            raise GetTimeoutError(f"{len(running) + len(queue)} battery units not done in time")
        free.append(running.pop(ready[0]))
        replies.append(EvalUnitReply.model_validate(ray.get(ready[0])))
    return replies
