"""An SFT or DPO step's gate metrics and eval battery, scored on the evaluating trainer
rank at the step's end (``stages.trainer.phase_eval``), never in the driver.

- before: the step's battery (``sft_dpo.step_battery``) on the base folder's weights,
  loaded on that rank for the scoring and freed after it (the policy there has been
  trained: the base folder is what the step started from, and it never changes);
- after: the same battery on the model the step's HF export is written from;
- the curriculum battery (``run_battery``) on that model, when the recipe names one,
  over the step's rows as chat-template text.

The numbers are those the driver computed from its own copies before (same functions,
same fp32 weights); the driver now only gets them back in ``PhaseEvalReply``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from stages.evals.config import EvalRunSettings


class StepEvalRequest(BaseModel):
    """What the evaluating rank scores for a post-training step. An rlvr step has no
    before/after scores here (its gate metrics are the rollouts' rewards), only its
    battery."""

    kind: Literal["sft", "dpo", "rlvr"]
    rows_path: str  # the step's digest-checked rows, as the private JSONL every rank reads
    base_dir: str  # the HF folder the step started from
    battery: str | None  # the curriculum battery after the step, if the recipe names one
    phase: str  # the battery result's label, e.g. "post_training.sft"


class StepEvalReply(BaseModel):
    before: dict[str, float]
    after: dict[str, float]
    battery: dict[str, Any]  # a BatteryResult as JSON; empty: no battery


def heldout_text(tok: Any, row: dict[str, Any]) -> str:
    """A step's row as the text the held-out checks score (chat template applied)."""
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


def evaluate_step(
    req: StepEvalRequest,
    model: Any,
    tokenizer: Any,
    *,
    settings: EvalRunSettings,
    work_dir: Path,
) -> StepEvalReply:
    """Score ``req`` on this rank; ``model`` holds the step's final weights."""
    import torch

    from stages.evals import run_battery
    from stages.post_training.hf_io import load_model
    from stages.post_training.objectives import read_rows
    from stages.post_training.sft_dpo import step_battery

    rows = read_rows(req.rows_path)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    if req.kind != "rlvr":
        device = next(model.parameters()).device
        base = load_model(Path(req.base_dir)).to(device)
        try:
            before = step_battery(req.kind, base, tokenizer, rows)
        finally:
            del base
            if device.type == "cuda":
                torch.cuda.empty_cache()
        after = step_battery(req.kind, model, tokenizer, rows)
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
    return StepEvalReply(before=before, after=after, battery=battery)
