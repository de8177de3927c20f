"""An SFT or DPO objective's gate metrics and eval battery, scored on the evaluating
trainer rank at the objective's end (``stages.trainer.phase_eval``), never in the driver.
The engine's part of post-training, so it lives below both: the trainer runs it, the
post-training stage asks for it and reads its reply.

- before: the objective's battery (``objective_battery``) on the base folder's
  weights, loaded on that rank for the scoring and freed after it (the policy there has
  been trained: the base folder is what the objective started from, and it never
  changes);
- after: the same battery on the model the objective's HF export is written from;
- the curriculum battery (``run_battery``) on that model, when the recipe names one,
  over the objective's rows as chat-template text.

The numbers are those the driver computed from its own copies before (same functions,
same fp32 weights); the driver now only gets them back in ``PhaseEvalReply``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from stages.evals.config import EvalRunSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ObjectiveEvalRequest(BaseModel):
    """What the evaluating rank scores for a post-training objective. The rlvr objective
    has no before/after scores here (its gate metrics are the rollouts' rewards), only
    its battery."""

    kind: Literal["sft", "dpo", "rlvr"]
    # The objective's digest-checked rows, as the private JSONL every rank reads.
    rows_path: str
    base_dir: str  # the HF folder the objective started from
    # The curriculum battery after the objective, if the recipe names one.
    battery: str | None
    phase: str  # the battery result's label, e.g. "post_training.sft"


class ObjectiveEvalReply(BaseModel):
    before: dict[str, float]
    after: dict[str, float]
    battery: dict[str, Any]  # a BatteryResult as JSON; empty: no battery


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an objective's JSONL snapshot (the stage already validated them)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def heldout_text(tok: PreTrainedTokenizerBase, row: dict[str, Any]) -> str:
    """An objective's row as the text the held-out checks score (chat template applied)."""
    if "messages" in row:
        msgs = row["messages"]
    elif "chosen" in row:
        prompt, chosen = row["prompt"], row["chosen"]
        msgs = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt) + (
            [{"role": "assistant", "content": chosen}] if isinstance(chosen, str) else chosen
        )
    else:
        prompt = row["prompt"]
        msgs = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt) + [
            {"role": "assistant", "content": row["answer"]}
        ]
    return str(tok.apply_chat_template(msgs, tokenize=False))


def evaluate_objective(
    req: ObjectiveEvalRequest,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    settings: EvalRunSettings,
    work_dir: Path,
) -> ObjectiveEvalReply:
    """Score ``req`` on this rank; ``model`` holds the objective's final weights."""
    import torch

    from stages.evals import run_battery
    from stages.evals.objective_battery import objective_battery
    from stages.hf import load_model

    rows = read_rows(req.rows_path)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    if req.kind != "rlvr":
        device = next(model.parameters()).device
        base = load_model(Path(req.base_dir)).to(device)
        try:
            before = objective_battery(req.kind, base, tokenizer, rows)
        finally:
            del base
            if device.type == "cuda":
                torch.cuda.empty_cache()
        after = objective_battery(req.kind, model, tokenizer, rows)
    battery: dict[str, Any] = {}
    if req.battery is not None:
        battery = run_battery(
            model,
            tokenizer,
            req.battery,
            [heldout_text(tokenizer, r) for r in rows],
            seq_len=int(model.config.max_position_embeddings),
            phase=req.phase,
            settings=settings,
            work_dir=work_dir,
        ).model_dump(mode="json")
    return ObjectiveEvalReply(before=before, after=after, battery=battery)
