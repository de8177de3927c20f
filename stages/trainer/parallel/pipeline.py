"""Pipeline parallel with ``torch.distributed.pipelining``, after torchtitan's
``pipeline_llama``: split the model into per-rank chunks by a manual layer split
(the plan's, uneven allowed), build a ``PipelineStage`` per chunk and the plan's
schedule (GPipe, 1F1B, Interleaved1F1B) over them.

A chunk keeps the full model's parameter names (``model.layers.<i>...``, the
embedding on the first chunk, norm and head on the last), like torchtitan's pruned
model copies, so distributed checkpoints stay layout-free: a checkpoint saved under
one split loads under any other, or under none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.trainer.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )


class StageModule(nn.Module):
    """Decoder layers ``[start, end)`` of the Llama (``stages.model.llama``), with
    the embedding if first and the final norm and head if last. Forward: token ids
    (first) or hidden states in, hidden states or logits out."""

    def __init__(self, full: nn.Module, start: int, end: int, *, first: bool, last: bool):
        super().__init__()
        inner: Any = full.model
        self.first, self.last = first, last
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = inner.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(start, end)})
        self.model.rotary_emb = inner.rotary_emb  # buffers only, on every chunk
        if last:
            self.model.norm = inner.norm
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner: Any = self.model
        h = inner.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = inner.rotary_emb(h, position_ids=pos)
        for layer in inner.layers.values():
            # attention_mask None: SDPA runs causal, as the full model does unpadded
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if self.last:
            head: Any = self.lm_head
            h = head(inner.norm(h))
        return h


class LocalModel(nn.Module):
    """Every chunk one pipeline rank holds (more than one with interleaving), under
    the full model's names: what the optimizer, checkpoints and healing see."""

    def __init__(self, chunks: list[StageModule]):
        super().__init__()
        self.model = nn.Module()
        layers: dict[str, nn.Module] = {}
        for c in chunks:
            cm: Any = c.model
            layers.update(dict(cm.layers.items()))
            if c.first:
                self.model.embed_tokens = cm.embed_tokens
            if c.last:
                self.model.norm = cm.norm
                self.lm_head = c.lm_head
        self.model.layers = nn.ModuleDict(dict(sorted(layers.items(), key=lambda kv: int(kv[0]))))


def split_model(
    full: nn.Module, layout: ParallelLayout, pp_rank: int
) -> tuple[list[int], list[StageModule]]:
    """This rank's chunks and their global stage indices (chunk ``j`` on rank ``j % pp``)."""
    inner: Any = full.model
    if getattr(getattr(full, "config", None), "tie_word_embeddings", False):
        from stages.errors import ErrorCode, ItoError

        raise ItoError(
            ErrorCode.layout_unsupported,
            "pipeline parallel cannot split a model with tied input and output "
            "embeddings (they sit on the first and last stages)",
        )
    bounds = layout.chunk_layers(len(inner.layers))
    ids = [j for j in range(len(bounds)) if j % layout.pp == pp_rank]
    chunks = [StageModule(full, *bounds[j], first=j == 0, last=j == len(bounds) - 1) for j in ids]
    return ids, chunks


def build_schedule(
    layout: ParallelLayout,
    chunks: list[nn.Module],
    stage_ids: list[int],
    device: torch.device,
    group: ProcessGroup,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Schedule1F1B | ScheduleGPipe | ScheduleInterleaved1F1B:
    """PipelineStages over this rank's chunks and the plan's schedule (torchtitan's
    ``build_pipeline_schedule``). Gradients are averaged over micro-batches."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    num_stages = layout.pp * layout.pp_virtual_stages
    # Any: torch's schedules take list[_PipelineStageBase], its private base class.
    stages: list[Any] = [
        PipelineStage(c, j, num_stages, device, group=group)
        for c, j in zip(chunks, stage_ids, strict=True)
    ]
    n = layout.pp_microbatches
    if layout.pp_schedule == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n, loss_fn=loss_fn)
    cls = ScheduleGPipe if layout.pp_schedule == "GPipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=n, loss_fn=loss_fn)
