"""Apply the plan's layout to the model of one replica-group rank, in torchtitan's
order (``parallelize_llama`` / ``pipeline_llama``):

1. fp8: swap the decoder's linears for torchao's ``Float8Linear`` (before TP, as
   torchtitan's model converters run before ``parallelize``);
2. pipeline split into this rank's chunks (each chunk is parallelized alone);
3. tensor parallel with DTensor ``parallelize_module``, module by module as
   transformers' own Llama TP plan shards them (q/k/v/gate/up colwise, o/down
   rowwise, embedding rowwise, head colwise), with sequence parallel on the norms on
   GPU; the head's logits stay sharded over the vocabulary and the ``lm`` loss runs
   on the shards under ``loss_parallel()`` (torchtitan's loss parallel), while the
   objectives that need whole rows of logits (SFT, DPO, GRPO) gather them;
4. context parallel: a ``context_parallel`` context around forward and backward
   that shards the sequence and swaps SDPA for ring attention (CUDA only);
5. activation checkpointing per decoder layer (none, selective, full), and with fp8
   each decoder layer's forward compiled (torchao's float8 needs the fusion);
6. FSDP2 over ``dp_shard x cp`` with bf16 parameters and fp32 reductions (bf16
   mixed precision); without FSDP, bf16 runs under autocast (fp32 master weights).

Steps 1, 3, 5 (the compile) and 6 are ``transforms.py``'s, applied chunk by chunk.
``ParallelModel`` then runs a step (forward + backward, through the pipeline
schedule where there is one), clips gradients over every mesh dimension, and reads
back the layout it really built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from stages.errors import ErrorCode, ItoError
from stages.model.lm import whole_rows
from stages.trainer.parallel.activation_checkpointing import apply_activation_checkpointing
from stages.trainer.parallel.layout import BuiltLayout, ParallelLayout, check_runnable
from stages.trainer.parallel.mesh import FSDP_DIM, mesh_coords, mesh_layout
from stages.trainer.parallel.pipeline import LocalModel, StageModule, build_schedule, split_model
from stages.trainer.parallel.transforms import (
    apply_fp8,
    apply_fsdp,
    apply_tp,
    compile_decoder_layers,
    decoder_layers,
)
from stages.trainer.rank.objective import Batch, Objective, Tensors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.tensor import Placement

    from stages.trainer.rank.ft import GradientReducer


# The objectives whose loss is a cross-entropy over the vocabulary, computed under TP
# on vocab-sharded logits (``loss_parallel()``) without gathering them; the others'
# losses read whole rows of logits (log-probs of chosen tokens, masks) and gather.
LOSS_PARALLEL_OBJECTIVES = frozenset({"lm"})


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: under ``loss_parallel()`` it is a DTensor replicated
    over the TP ranks, whose local value is the whole loss."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss


class _StageShare(TypedDict):
    pp_rank: int
    layers: int


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 of a pipeline micro-batch (pre-shifted
    labels; equals ``model.causal_lm_loss``)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100
    )


class ParallelModel:
    """One rank's share of the model under the layout, and how to train a step on it."""

    def __init__(
        self,
        full: nn.Module,
        layout: ParallelLayout,
        mesh: DeviceMesh | None,
        device: torch.device,
        *,
        sequence_parallel: bool | None = None,
        planned_micro_batch_at: Callable[[int], int] | None = None,
    ):
        # The plan's sequences per data-parallel rank at a sequence length: what its
        # memory was checked for. A shrink below the planned groups grows each rank's
        # share past it; the rank then takes more passes (``passes``). None: the plan's.
        self.planned_micro_batch_at = planned_micro_batch_at
        if layout.dp_shard == -1 or (layout.pp > 1 and not layout.pp_microbatches):
            layout = layout.resolved(int(mesh.size()) if mesh is not None else 1)
        self.layout = layout
        config: Any = full.config
        self.hidden = int(config.hidden_size)
        self.mesh = mesh
        self.device = device
        self.coords = (
            mesh_coords(mesh)
            if mesh is not None
            else dict.fromkeys(("pp", "dp_shard", "cp", "tp"), 0)
        )
        check_runnable(
            layout,
            device.type,
            torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        )
        if mesh is None and layout.tp * layout.pp * layout.cp * layout.dp_shard != 1:
            raise ItoError(
                ErrorCode.plan_degrees_mismatch,
                "a single-rank replica group cannot run a multi-rank layout",
            )
        # Sequence parallel on the norms: on by default on GPU (torchtitan's default);
        # on CPU only when asked (tests), as its reduce-scatters gain nothing on gloo.
        if sequence_parallel is None:
            sequence_parallel = device.type == "cuda"
        self.sequence_parallel = sequence_parallel and layout.tp > 1
        self.fp8_linears = apply_fp8(full) if layout.precision == "fp8" else 0
        apply_activation_checkpointing(full, layout.activation_checkpointing)
        # fp8 is a CUDA-only layout (check_runnable), so CPU never compiles.
        self.compiled_layers = compile_decoder_layers(full) if self.fp8_linears else 0
        self.schedule: Schedule1F1B | ScheduleGPipe | ScheduleInterleaved1F1B | None = None
        self._scale = 1.0
        if layout.pp > 1:
            self.stage_ids, chunks = split_model(full, layout, self.coords["pp"])
            self.chunks: list[nn.Module] = list(chunks)
        else:
            self.stage_ids, self.chunks = [0], [full]
        fsdp = layout.dp_shard * layout.cp > 1
        bf16 = layout.precision in ("bf16", "fp8")
        for chunk in self.chunks:
            if layout.tp > 1:
                apply_tp(
                    chunk,
                    self._dim("tp"),
                    sequence_parallel=self.sequence_parallel,
                    fp8=layout.precision == "fp8",
                )
            if fsdp:
                apply_fsdp(
                    chunk,
                    self._dim(FSDP_DIM),
                    param_dtype=torch.bfloat16 if bf16 else None,
                    pp_enabled=layout.pp > 1,
                )
        self.autocast = bf16 and not fsdp
        if layout.pp > 1:
            first = self.chunks[0]
            self.module: nn.Module = (
                first
                if len(self.chunks) == 1
                else LocalModel([c for c in self.chunks if isinstance(c, StageModule)])
            )
            self.schedule = build_schedule(
                layout,
                self.chunks,
                self.stage_ids,
                device,
                self._dim("pp").get_group(),
                self._loss_fn,
            )
        else:
            self.module = full
        self.num_stages = layout.pp * layout.pp_virtual_stages

    def _dim(self, name: str) -> DeviceMesh:
        """One dimension of the group's mesh (a layout over more than one rank has a
        mesh: the constructor refuses one without)."""
        assert self.mesh is not None
        return self.mesh[name]

    # --- a step -------------------------------------------------------------------
    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return local_loss(token_loss(logits, labels)) * self._scale

    @contextlib.contextmanager
    def _context(
        self, buffers: list[torch.Tensor], *, loss_parallel: bool = False
    ) -> Iterator[None]:
        """CP, bf16 autocast and, for a loss on vocab-sharded logits, ``loss_parallel()``
        (its cross-entropy's backward needs it too: the step's backward runs inside)."""
        with contextlib.ExitStack() as stack:
            if loss_parallel and self.layout.tp > 1:
                from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel

                stack.enter_context(vocab_parallel())
            if self.layout.cp > 1:  # CUDA only (check_runnable)
                from torch.distributed.tensor.experimental import context_parallel
                from torch.distributed.tensor.experimental._attention import set_rotate_method

                set_rotate_method("allgather")
                stack.enter_context(
                    context_parallel(
                        self._dim("cp"),
                        buffers=buffers,
                        buffer_seq_dims=[1] * len(buffers),
                        no_restore_buffers=set(buffers),
                    )
                )
            if self.autocast:
                stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
            yield

    @torch.no_grad()
    def forward_logits(self, inputs: Tensors) -> torch.Tensor:
        """Evaluation logits for an objective's ``model_inputs`` (no pipeline, no CP:
        the objectives that need it, as DPO's reference pass, refuse both)."""
        with self._context([]):
            return whole_rows(self.module(**inputs).logits)

    def forward_backward(
        self,
        batch: Batch,
        objective: Objective,
        *,
        scale: float = 1.0,
        reducer: GradientReducer | None = None,
    ) -> torch.Tensor:
        """Forward and backward of this rank's batch under ``objective``; returns the
        rank's loss, ``loss_sum / denominator`` (0 on pipeline ranks without the last
        stage). ``reducer``: the replica groups' gradient reduction, started during the
        last micro-batch's backward where the parameters are plain tensors."""
        self._scale = scale
        vocab_parallel = objective.name in LOSS_PARALLEL_OBJECTIVES
        if self.schedule is None:
            # The plan's micro-batches: equal dim-0 slices, each one's summed loss over
            # the whole batch's denominator, so the gradients sum to the batch's mean.
            total = torch.zeros((), device=self.device)
            parts = batch.split(self.passes(batch))
            for i, part in enumerate(parts):
                inputs = objective.model_inputs(part)
                ids = inputs["input_ids"].contiguous()
                pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
                part = {k: v.contiguous() for k, v in part.items()}
                extra = {k: v.contiguous() for k, v in inputs.items() if k != "input_ids"}
                # CP shards the sequence dim of every buffer in place (LM only: the
                # config refuses cp > 1 for the other objectives).
                buffers = [ids, pos, *[v for v in part.values() if v.dim() == 2]]
                with self._context(buffers, loss_parallel=vocab_parallel):
                    logits = self.module(input_ids=ids, position_ids=pos, **extra).logits
                    if not vocab_parallel:
                        logits = whole_rows(logits)
                    loss = local_loss(objective.loss_sum(logits, part))
                    loss = loss * (scale / batch.denominator)
                    # Nothing the backward needs is the logits themselves (the loss saved
                    # its log-probs): dropping them first keeps b x V bytes a token off
                    # the backward's peak, as torchtitan's ``del pred``.
                    del logits
                    if reducer is not None and self.mesh is None and i == len(parts) - 1:
                        reducer.arm()
                    loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
                total = total + loss.detach()
            return total
        if objective.name != "lm":  # config validation refuses it; this says why
            raise ItoError(
                ErrorCode.plan_objective_unsupported,
                f"the {objective.name} objective does not run through a pipeline schedule",
            )
        input_ids = batch.tensors["input_ids"]
        labels = batch.tensors["labels"]
        losses: list[torch.Tensor] = []
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        args = (input_ids,) if first else ()
        with self._context([], loss_parallel=vocab_parallel):
            # return_outputs=False: the last stage would keep every micro-batch's logits
            self.schedule.step(
                *args,
                target=labels if last else None,
                losses=losses if last else None,
                return_outputs=False,
            )
        if not last:
            return torch.zeros((), device=input_ids.device)
        return torch.stack([x.detach() for x in losses]).mean()

    def passes(self, batch: Batch) -> int:
        """Forward/backward passes for ``batch``: the plan's accumulation steps, more
        where the rank's share outgrew the plan's (a shrink below its groups), so no
        pass takes more sequences than the plan's did (torchtitan keeps the local batch
        and accumulates the same way)."""
        accum = self.layout.grad_accum
        rows = int(next(iter(batch.tensors.values())).shape[0])
        if self.planned_micro_batch_at is None:
            return min(accum, rows)
        # The plan's largest pass (its micro-batch over its steps, the last ones shorter).
        per_pass = max(1, -(-self.planned_micro_batch_at(batch.seq_len) // accum))
        return min(rows, max(accum, -(-rows // per_pass)))

    def group_mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The replica group's loss: the mean over its data-parallel ranks of the loss
        held by each one's last pipeline stage (TP ranks hold copies, CP ranks parts)."""
        if self.mesh is None:
            return loss.detach()
        import torch.distributed as dist

        holds = self.coords["pp"] == self.layout.pp - 1 and self.coords["tp"] == 0
        t = (loss.detach().float() if holds else torch.zeros((), device=loss.device)).reshape(1)
        t = t.clone()
        dist.all_reduce(t)  # gloo has no AVG
        return t / (self.layout.dp_shard * self.layout.cp)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm over every parameter of the model (all pipeline
        stages, TP and FSDP shards): per kind of DTensor, a local norm made global by
        ``full_tensor``, then summed over the pipeline ranks (torchtitan's approach)."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.module.parameters() if p.grad is not None]
        kinds: dict[tuple[DeviceMesh, tuple[Placement, ...]] | None, list[torch.Tensor]] = {}
        for p in params:
            g = p.grad
            assert g is not None  # params: those with a gradient
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            kinds.setdefault(key, []).append(g)
        total_sq = torch.zeros((), device=self.device)
        for key, grads in kinds.items():
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
            if key is not None:  # DTensor gradients: a DTensor norm
                assert isinstance(norm, DTensor)
                norm = norm.full_tensor()
            total_sq = total_sq + norm.float() ** 2
        if self.layout.pp > 1:
            import torch.distributed as dist

            dist.all_reduce(total_sq, group=self._dim("pp").get_group())
        total = float(total_sq.sqrt())
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for p in params:
                    g = p.grad
                    assert g is not None
                    g.mul_(coef)
        return total

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Evaluation forward: the full logits on the last pipeline stage (every TP
        rank), None on the other pipeline ranks. Pipelines pass activations by p2p."""
        if self.schedule is None:
            with self._context([]):
                return whole_rows(self.module(input_ids=input_ids).logits).float()
        import torch.distributed as dist

        if self.layout.pp_virtual_stages != 1:
            raise ItoError(
                ErrorCode.layout_unsupported,
                "evaluation forward of an interleaved pipeline is not built",
            )
        group, r = self._dim("pp").get_group(), self.coords["pp"]
        x = input_ids
        if r > 0:
            x = torch.empty(*input_ids.shape, self.hidden, device=self.device)
            dist.recv(x, group=group, group_src=r - 1)
        with self._context([]):
            stage_out: torch.Tensor = self.chunks[0](x).float()
        if r < self.layout.pp - 1:
            dist.send(stage_out.contiguous(), group=group, group_dst=r + 1)
            return None
        return whole_rows(stage_out)

    # --- what was built -------------------------------------------------------------
    def built_layout(self) -> BuiltLayout:
        """The layout as built, read back from the mesh, the schedule, the chunks and
        the modules (not from the plan). Collective over the group when there is one."""
        degrees = (
            mesh_layout(self.mesh)
            if self.mesh is not None
            else dict.fromkeys(("pp", "dp_shard", "cp", "tp"), 1)
        )
        mine: _StageShare = {
            "pp_rank": self.coords["pp"],
            "layers": sum(len(decoder_layers(c)) for c in self.chunks),
        }
        per_rank = [mine]
        if self.mesh is not None:
            import torch.distributed as dist

            gathered: list[_StageShare | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            per_rank = [share for share in gathered if share is not None]  # every rank's
        stage_layers = [0] * degrees["pp"]
        for item in per_rank:
            stage_layers[item["pp_rank"]] = item["layers"]
        layers = decoder_layers(self.chunks[0])
        ac = "none"
        if layers and getattr(layers[0], "gradient_checkpointing", False):
            fn = getattr(layers[0], "_gradient_checkpointing_func", None)
            ac = "selective" if "context_fn" in getattr(fn, "keywords", {}) else "full"
        params = [p for p in self.module.parameters()]
        fsdp_dtype = None
        for m in self.module.modules():
            state = getattr(m, "_get_fsdp_state", None)
            if callable(state):
                fsdp_dtype = state()._mp_policy.param_dtype
                break
        precision = (
            "fp8"
            if self.fp8_linears
            else (
                "bf16"
                if fsdp_dtype == torch.bfloat16 or self.autocast
                else str(params[0].dtype).removeprefix("torch.").replace("float32", "fp32")
            )
        )
        schedule = None
        if self.schedule is not None:
            schedule = {
                "ScheduleGPipe": "GPipe",
                "Schedule1F1B": "1F1B",
                "ScheduleInterleaved1F1B": "Interleaved1F1B",
            }.get(type(self.schedule).__name__, type(self.schedule).__name__)
        return {
            "pp": degrees["pp"],
            "dp_shard": degrees["dp_shard"],
            "cp": degrees["cp"],
            "tp": degrees["tp"],
            "pp_schedule": schedule,
            "pp_microbatches": self.schedule._n_microbatches if self.schedule else 1,
            "pp_stage_layers": stage_layers,
            "activation_checkpointing": ac,
            "precision": precision,
            "sequence_parallel": self.sequence_parallel,
        }
