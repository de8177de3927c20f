"""SFT and DPO as objectives of the training engine (``stages.trainer.rank.objective``).

trl is the reference for what a batch is and what its loss is; these objectives use
its tokenization helpers and collators and reproduce its ``compute_loss`` (the
oracle tests, tests/post_training/test_objectives.py, check loss and gradients
against ``SFTTrainer`` / ``DPOTrainer`` on the same batch and weights):

- SFT (``SFTTrainer`` with ``assistant_only_loss=True``): conversational rows through
  the tokenizer's chat template, the assistant tokens (stop token included) as
  targets, truncated to ``max_length`` (keep the start), fully masked rows dropped;
  the loss is the summed target NLL over the *global* batch's target count (trl's
  ``num_items_in_batch`` with ``average_tokens_across_devices``).
- DPO (``DPOTrainer``, ``loss_type="sigmoid"``, ``precompute_ref_log_probs=True``):
  ``-logsigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))``,
  averaged over pairs; sequence log-probs are sums over the completion tokens.

Batches are indexed by step: the global batch of data index ``i`` is rows
``order[i*B : (i+1)*B]`` of a per-epoch seeded permutation, and data-parallel rank
``r`` of ``W`` takes the ``r``-th of ``W`` equal slices. Every rank tokenizes every row
at start-up, so it can count the global batch's targets without a collective.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from stages.errors import ErrorCode, ItoError
from stages.evals.objective_eval import read_rows
from stages.trainer.rank.objective import (
    Batch,
    LaidOutModel,
    Objective,
    Tensors,
    token_nll_sum,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stages.trainer.config import TrainStageConfig

# The run tokenizer's chat template before it carried generation markers (same text):
# folders exported then are trained with the marked template.
_UNMARKED_ITO_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|bos|>' + message['role'] + '\n' + message['content'] + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}"
)


def training_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template SFT tokenizes with, as trl picks it: the tokenizer's own when it
    has ``{% generation %}`` markers (None), else trl's training version of it."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    from stages.hf import CHAT_TEMPLATE

    if has_generation_markers(tokenizer.chat_template):
        return None
    if tokenizer.chat_template == _UNMARKED_ITO_TEMPLATE:
        return CHAT_TEMPLATE
    try:
        return get_training_chat_template(tokenizer)
    except ValueError as e:
        raise ItoError(
            ErrorCode.post_training_model_invalid,
            "the base model's chat template has no {% generation %} markers and trl has "
            "no training version of it: the assistant tokens SFT trains cannot be found",
        ) from e


def as_messages(x: str | list[dict[str, str]], role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": x}] if isinstance(x, str) else list(x)


class StepRows:
    """Which rows data index ``i`` trains, on which data-parallel rank."""

    def __init__(self, n_rows: int, batch_size: int, dp_rank: int, dp_world: int, seed: int):
        if n_rows < 1:
            raise ItoError(ErrorCode.post_training_data_invalid, "no trainable rows")
        self.n, self.batch, self.seed = n_rows, batch_size, seed
        self.per_rank = batch_size // dp_world
        self.dp_rank = dp_rank
        self._orders: dict[int, list[int]] = {}

    def _epoch(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s seeded permutation of the rows (the last two kept)."""
        if epoch not in self._orders:
            order = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def global_rows(self, index: int) -> list[int]:
        start = index * self.batch
        return [self._epoch(p // self.n)[p % self.n] for p in range(start, start + self.batch)]

    def rank_rows(self, index: int) -> list[int]:
        rows = self.global_rows(index)
        return rows[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]


def sft_example(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    max_length: int,
    chat_template: str | None,
) -> dict[str, list[int]]:
    """trl's SFT preparation of one conversational row with ``assistant_only_loss``:
    tokenize with the assistant mask, labels = ids on assistant tokens else -100,
    truncate both to ``max_length`` (keep the start)."""
    from trl.data_utils import _tokenize

    out = _tokenize(
        tokenizer, messages, return_assistant_tokens_mask=True, chat_template=chat_template
    )
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    labels = [t if m else -100 for t, m in zip(ids, mask, strict=True)]
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}


def _preshift(labels: torch.Tensor) -> torch.Tensor:
    """Unshifted labels (trl's, the model shifts) to targets aligned with positions."""
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


class SFTObjective:
    name = "sft"

    def __init__(
        self,
        rows: list[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
    ):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        template = training_chat_template(tokenizer)
        examples = [sft_example(tokenizer, r["messages"], max_length, template) for r in rows]
        # trl drops the rows truncation left without a target.
        self.examples = [e for e in examples if any(t != -100 for t in e["labels"])]
        # Targets after the shift (what the loss averages over), per row.
        self.targets = [sum(t != -100 for t in e["labels"][1:]) for e in self.examples]
        self.rows = StepRows(len(self.examples), batch_size, dp_rank, dp_world, seed)
        self.dp_world = dp_world
        self.collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)

    def batch(self, index: int) -> Batch:
        mine = self.rows.rank_rows(index)
        out = self.collate([self.examples[i] for i in mine])
        everyone = sum(self.targets[i] for i in self.rows.global_rows(index))
        return Batch(
            {
                "input_ids": out["input_ids"],
                "attention_mask": out["attention_mask"],
                "labels": _preshift(out["labels"]),
            },
            denominator=max(everyone, 1) / self.dp_world,
            tokens=int(out["attention_mask"].sum()),
        )

    def model_inputs(self, part: Tensors) -> Tensors:
        return {"input_ids": part["input_ids"], "attention_mask": part["attention_mask"]}

    def loss_sum(self, logits: torch.Tensor, part: Tensors) -> torch.Tensor:
        return token_nll_sum(logits, part["labels"])


def dpo_example(tokenizer: PreTrainedTokenizerBase, row: dict[str, Any]) -> dict[str, list[int]]:
    """trl's DPO tokenization of one conversational row: prompt (with the generation
    prompt), chosen and rejected continuations from where they diverge from it.
    String rows become one user and one assistant message, as the gates score them."""
    from trl.data_utils import _tokenize, common_prefix_length

    prompt = as_messages(row["prompt"], "user")
    p = _tokenize(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
    c = _tokenize(tokenizer, prompt + as_messages(row["chosen"], "assistant"))["input_ids"]
    r = _tokenize(tokenizer, prompt + as_messages(row["rejected"], "assistant"))["input_ids"]
    n = min(common_prefix_length(p, c), common_prefix_length(p, r))
    return {"prompt_ids": list(p[:n]), "chosen_ids": list(c[n:]), "rejected_ids": list(r[n:])}


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum of target log-probs (pre-shifted labels, -100 none), fp32."""
    nll = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    )
    return -nll.view(labels.shape).sum(dim=1)


def _pairs_flat(t: torch.Tensor) -> torch.Tensor:
    """[b, 2, ...] pairs as trl's [chosen..., rejected...] batch of 2b."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


class DPOObjective:
    """Sigmoid DPO against reference log-probs computed once, at the rank's start-up.

    The reference is the base model, and every rank builds its policy from the base
    folder (``RankSetup.build``), which stays on disk for the whole run: so the rank
    computes the reference log-probs of every row from its freshly loaded weights,
    before any checkpoint restore or torchft heal overwrites them. A restarted or
    replacement rank does the same. No second resident model copy, and no checkpoint
    field (a checkpoint would only duplicate what the base folder determines).
    """

    name = "dpo"

    def __init__(
        self,
        rows: list[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        beta: float,
        max_length: int,
        batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
    ):
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        self.beta = beta
        examples = [dpo_example(tokenizer, r) for r in rows]
        # trl (keep_start) drops pairs whose prompt alone fills max_length.
        self.examples = [e for e in examples if len(e["prompt_ids"]) < max_length]
        self.rows = StepRows(len(self.examples), batch_size, dp_rank, dp_world, seed)
        self.collate = DataCollatorForPreference(
            pad_token_id=tokenizer.pad_token_id, max_length=max_length
        )
        self.ref_logps: torch.Tensor | None = None  # [rows, 2]: chosen, rejected

    def _tensors(self, idx: list[int]) -> Tensors:
        out = self.collate([self.examples[i] for i in idx])
        b = len(idx)
        ids, attn, comp = out["input_ids"], out["attention_mask"], out["completion_mask"]
        labels = _preshift(ids.masked_fill(comp == 0, -100))

        def pairs(t: torch.Tensor) -> torch.Tensor:  # [2b, L] -> [b, 2, L]
            return torch.stack([t[:b], t[b:]], dim=1)

        return {"input_ids": pairs(ids), "attention_mask": pairs(attn), "labels": pairs(labels)}

    @torch.no_grad()
    def precompute_reference(
        self,
        forward_logits: Callable[[Tensors], torch.Tensor],
        chunk: int,
        device: torch.device,
    ) -> None:
        """Reference log-probs of every row, ``chunk`` pairs a forward (the same count
        on every rank of a group, as a sharded forward is a collective)."""
        out = []
        n = len(self.examples)
        for s in range(0, n, chunk):
            part = self._tensors(list(range(s, min(s + chunk, n))))
            t = {k: v.to(device) for k, v in part.items()}
            logits = forward_logits(self.model_inputs(t))
            logps = sequence_logps(logits, _pairs_flat(t["labels"]))
            out.append(torch.stack(logps.chunk(2), dim=1).cpu())
        self.ref_logps = torch.cat(out)

    def batch(self, index: int) -> Batch:
        assert self.ref_logps is not None, "precompute_reference first"
        mine = self.rows.rank_rows(index)
        t = self._tensors(mine)
        t["ref_logps"] = self.ref_logps[mine]
        return Batch(t, denominator=float(len(mine)), tokens=int(t["attention_mask"].sum()))

    def model_inputs(self, part: Tensors) -> Tensors:
        return {
            "input_ids": _pairs_flat(part["input_ids"]),
            "attention_mask": _pairs_flat(part["attention_mask"]),
        }

    def loss_sum(self, logits: torch.Tensor, part: Tensors) -> torch.Tensor:
        chosen, rejected = sequence_logps(logits, _pairs_flat(part["labels"])).chunk(2)
        ref = part["ref_logps"].to(chosen.dtype)
        delta = (chosen - ref[:, 0]) - (rejected - ref[:, 1])
        return -F.logsigmoid(self.beta * delta).sum()


def build_objective(
    cfg: TrainStageConfig, parallel: LaidOutModel, *, dp_rank: int, device: torch.device
) -> Objective:
    """The run's sft, dpo or grpo objective (``cfg``: a ``TrainStageConfig``); the tokenizer
    is the base folder's. DPO's reference log-probs are computed here, on ``parallel``
    (the freshly loaded base weights)."""
    from stages.hf import load_tokenizer

    obj = cfg.objective
    if obj.kind == "grpo":
        from stages.post_training.grpo_objective import build_grpo_objective

        return build_grpo_objective(cfg, dp_rank=dp_rank, device=device, parallel=parallel)
    folder = cfg.model.tokenizer_path or cfg.model.checkpoint_path
    if folder is None:
        raise ItoError(
            ErrorCode.post_training_model_invalid,
            f"the {obj.kind} objective trains an HF model folder; none is named",
        )
    tok = load_tokenizer(folder)
    assert obj.data_path is not None  # ObjectiveConfig: set for every post-training kind
    rows = read_rows(obj.data_path)
    common = dict(
        max_length=obj.max_length,
        batch_size=obj.batch_size,
        dp_rank=dp_rank,
        dp_world=cfg.dp_world,
        seed=cfg.target.seed,
    )
    if obj.kind == "sft":
        return SFTObjective(rows, tok, **common)
    dpo = DPOObjective(rows, tok, beta=obj.beta, **common)
    dpo.precompute_reference(parallel.forward_logits, max(1, cfg.micro_batch), device)
    return dpo
