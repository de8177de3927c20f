"""A phase's eval battery and HF export, run on trainer ranks while the fleet waits at
the phase's end (never in the driver).

Held-out loss and bits per byte are split over the data-parallel ranks: rank 0 of
every live replica group scores its share of the held-out windows
(``heldout_share``) and the engine adds the sums up (``stages.evals.heldout``); the
rest of the battery and the export run on rank 0 of the lowest live replica group.
A single-rank group holds the whole live model: the battery runs on it directly (it
is bit-identical to the closing checkpoint: nothing updated it since the save). A
rank whose model is laid out over several ranks (FSDP2, TP, PP), recomputes
activations or runs fp8 linears loads the closing checkpoint into a fresh, plain
model in its own process instead (``load_phase_model``). Either way the scores are
those of the closing checkpoint, and the driver only sees numbers and paths.

The HF export is always streamed from the closing checkpoint, a safetensors shard at
a time: every live rank writes its share of the shards into the export's staging
folder (``export_share``, every n-th shard), and the evaluating rank completes and
renames it (``export_phase``: index, config, tokenizer, each file's writer in
``ito_export.json``). A phase without a battery (a post-training objective with
no scoring) builds no model at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from stages.curriculum.schedule import PhaseSpan
from stages.errors import ErrorCode, ItoError
from stages.evals.config import EvalRunSettings
from stages.evals.heldout import HeldoutSums
from stages.post_training.objective_eval import (
    ObjectiveEvalReply,
    ObjectiveEvalRequest,
    evaluate_objective,
)
from stages.trainer.config import TrainStageConfig

if TYPE_CHECKING:  # the driver builds requests here; the ranks import torch
    import torch

    from stages.checkpointing.sealed import SealedCheckpoint


class PhaseEvalRequest(BaseModel):
    """What the driver asks the evaluating rank to do at a phase's end."""

    phase: PhaseSpan
    checkpoint: str
    step: int
    heldout_path: str
    tokenizer_dir: str
    work_dir: str
    export_dir: str
    metadata: dict[str, Any]
    settings: EvalRunSettings
    # A post-training objective: its gate metrics and battery, scored here too.
    post_training: ObjectiveEvalRequest | None = None
    # The held-out shares of every data-parallel rank, reduced; None: the battery has
    # no held-out check (or the evaluating rank scores the whole split).
    heldout_sums: HeldoutSums | None = None
    # The export's staging folder, agreed by every rank that writes shards into it
    # (``export_share``), and which rank wrote each file; None: the evaluating rank
    # writes every shard itself.
    export_token: str | None = None
    export_writers: dict[str, str] | None = None

    def needs_heldout(self) -> bool:
        from stages.evals.config import load_battery

        battery = self.phase.eval_battery
        return battery is not None and any(
            c.kind == "heldout" for c in load_battery(battery).checks
        )

    def heldout_texts(self) -> list[str]:
        return [
            json.loads(line)["text"]
            for line in Path(self.heldout_path).read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]


class PhaseEvalReply(BaseModel):
    result: dict[str, Any]  # a BatteryResult, as JSON; empty: the phase has no battery
    export: str
    live_model: bool
    post_training: ObjectiveEvalReply | None = None


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


def load_phase_model(
    cfg: TrainStageConfig, phase: PhaseSpan, checkpoint: str | SealedCheckpoint
) -> Any:
    """The weights of a complete checkpoint (a path, or one whose seal was checked) in
    a fresh model of the phase's shape."""
    from stages.checkpointing.seal import seal_key
    from stages.checkpointing.sealed import SealedCheckpoint
    from stages.presets import load_model_preset
    from stages.trainer.model import build_model, set_rope_theta

    # Only a checkpoint this backend sealed is unpickled (docs/checkpointing.md).
    sealed = (
        checkpoint
        if isinstance(checkpoint, SealedCheckpoint)
        else SealedCheckpoint(Path(checkpoint), seal_key())
    )
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


def _export_config(cfg: TrainStageConfig, *, rope_theta: float | None) -> Any:
    """The transformers config a phase's export is written with (its RoPE base)."""
    from stages.presets import load_model_preset
    from stages.trainer.model import model_config, set_config_rope_theta

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
    from stages.checkpointing.seal import seal_key
    from stages.checkpointing.sealed import SealedCheckpoint
    from stages.hf.export import export_shards, staging_dir

    if req.export_token is None:
        raise ItoError(ErrorCode.invalid_state, "an export share needs the export's token")
    files = export_shards(
        SealedCheckpoint(Path(req.checkpoint), seal_key()),
        _export_config(cfg, rope_theta=req.phase.rope_theta),
        staging_dir(req.export_dir, req.export_token),
        part=part,
        parts=parts,
        shard_bytes=req.settings.export_shard_bytes,
    )
    return dict.fromkeys(files, writer)


def export_phase(
    req: PhaseEvalRequest, cfg: TrainStageConfig, tokenizer: Any, sealed: SealedCheckpoint
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
    req: PhaseEvalRequest, *, cfg: TrainStageConfig, live: torch.nn.Module | None
) -> PhaseEvalReply:
    """Run the phase's battery (a phase without one, e.g. a post-training objective, is
    only exported: ``result`` is empty), a post-training objective's own scores, and
    write its HF export; ``live`` is this rank's whole model when it can serve (see the module
    docstring), else None."""
    from stages.checkpointing.seal import seal_key
    from stages.checkpointing.sealed import SealedCheckpoint
    from stages.evals import run_battery
    from stages.hf import load_tokenizer

    tokenizer = load_tokenizer(req.tokenizer_dir)
    # The seal is checked once (it reads every file): for the export and, on a rank
    # without a whole live model, for the model the battery scores.
    sealed = SealedCheckpoint(Path(req.checkpoint), seal_key())
    result: dict[str, Any] = {}
    scored: ObjectiveEvalReply | None = None
    if req.phase.eval_battery is None and req.post_training is None:
        export = export_phase(req, cfg, tokenizer, sealed)
        return PhaseEvalReply(result=result, export=str(export), live_model=False)
    model = live if live is not None else load_phase_model(cfg, req.phase, sealed)
    was_training = model.training
    try:
        if req.phase.eval_battery is not None:
            result = run_battery(
                model,
                tokenizer,
                req.phase.eval_battery,
                req.heldout_texts() if req.heldout_sums is None else [],
                seq_len=req.phase.seq_len,
                phase=req.phase.name,
                step=req.step,
                settings=req.settings,
                work_dir=Path(req.work_dir),
                heldout_sums=req.heldout_sums,
            ).model_dump(mode="json")
        export = export_phase(req, cfg, tokenizer, sealed)
        if req.post_training is not None:
            scored = evaluate_objective(
                req.post_training,
                model,
                tokenizer,
                settings=req.settings,
                work_dir=Path(req.work_dir),
            )
    finally:
        model.train(was_training)
    return PhaseEvalReply(
        result=result, export=str(export), live_model=live is not None, post_training=scored
    )


def heldout_share(
    req: PhaseEvalRequest,
    *,
    cfg: TrainStageConfig,
    live: torch.nn.Module | None,
    part: int,
    parts: int,
) -> HeldoutSums:
    """This data-parallel rank's share of the phase's held-out windows, scored on its
    live model (or the closing checkpoint, as ``evaluate_on_rank`` chooses)."""
    from stages.evals.heldout import heldout_sums
    from stages.hf import load_tokenizer

    model = live if live is not None else load_phase_model(cfg, req.phase, req.checkpoint)
    s = req.settings
    return heldout_sums(
        model,
        load_tokenizer(req.tokenizer_dir),
        req.heldout_texts(),
        seq_len=s.heldout_seq_len or req.phase.seq_len,
        max_tokens=s.heldout_max_tokens,
        batch_size=s.batch_size,
        part=part,
        parts=parts,
    )
