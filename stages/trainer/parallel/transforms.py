"""The transformations a layout applies to each model chunk, in torchtitan's order
(``parallelize_llama``): fp8 linears, tensor parallel with transformers' Llama TP
plan, per-layer compile (with fp8), and FSDP2. ``ParallelModel`` (``parallelize.py``)
calls them chunk by chunk after the pipeline split."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.errors import ErrorCode, ItoError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Llama or of a pipeline chunk (a ``ModuleDict`` by index)."""
    layers = module.get_submodule("model.layers")
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    assert isinstance(layers, nn.ModuleList)
    return list(layers)


def apply_fp8(model: nn.Module) -> int:
    """torchao float8 training on the decoder's linears (the head stays bf16, and
    torchao needs both dimensions divisible by 16). Returns the linears converted."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise ItoError(
            ErrorCode.layout_unsupported, "fp8 needs torchao (pip install 'ito-train[gpu]')"
        ) from e

    def keep(mod: nn.Module, fqn: str) -> bool:
        return (
            isinstance(mod, nn.Linear)
            and "lm_head" not in fqn
            and mod.in_features % 16 == 0
            and mod.out_features % 16 == 0
        )

    convert_to_float8_training(model, module_filter_fn=keep)
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` each decoder layer's forward (torchtitan's per-block
    ``apply_compile``): torchao's float8 casts and scales are only fast fused, and
    uncompiled fp8 trains slower than bf16 (half the tokens/s on an H200). The
    forward is compiled in place, so module hooks (FSDP's) stay outside the compiled
    region and parameter names stay as they are. Returns the layers compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)


def apply_tp(chunk: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, fp8: bool) -> None:
    """transformers' Llama TP plan (``base_model_tp_plan``) on one model chunk, with
    the head's logits left sharded over the vocabulary (torchtitan's loss parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel.style import ParallelStyle

    colwise: type[ColwiseParallel] = ColwiseParallel
    rowwise: type[RowwiseParallel] = RowwiseParallel
    prepare: type[PrepareModuleInput] = PrepareModuleInput
    if fp8:  # tensorwise float8 all-gathers in fp8 (torchtitan's float8 TP)
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare = (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {}
    inner = chunk.get_submodule("model")
    head = getattr(chunk, "lm_head", None)
    embed = getattr(inner, "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    if hasattr(inner, "embed_tokens"):
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if hasattr(inner, "norm"):
        if sequence_parallel:
            top["model.norm"] = SequenceParallel()
        # Loss parallel (torchtitan's): the logits stay sharded over the vocabulary, a
        # DTensor; the LM loss runs on the shards under ``loss_parallel()``, and the
        # objectives that need whole rows gather them (``ParallelModel``).
        top["lm_head"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
    if top:
        parallelize_module(chunk, tp_mesh, top)
    if tied:
        # Each style made its own DTensor of the one weight, which would then train as
        # two: tie them again (both are sharded over the vocabulary, Shard(0)), as
        # torchtitan does after its TP plan.
        assert embed is not None and head is not None
        head.weight = embed.weight
    for layer in decoder_layers(chunk):
        plan: dict[str, ParallelStyle] = {
            "self_attn.q_proj": colwise(),
            "self_attn.k_proj": colwise(),
            "self_attn.v_proj": colwise(),
            "self_attn.o_proj": rowwise(output_layouts=seq),
            "mlp.gate_proj": colwise(),
            "mlp.up_proj": colwise(),
            "mlp.down_proj": rowwise(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update(
                {
                    "input_layernorm": SequenceParallel(),
                    "post_attention_layernorm": SequenceParallel(),
                    "self_attn": prepare(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    ),
                    "mlp": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(layer, tp_mesh, plan)


def apply_fsdp(
    chunk: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None, pp_enabled: bool
) -> None:
    """FSDP2 per decoder layer, embedding, [norm, head] and the chunk (torchtitan's
    ``apply_fsdp``); with PP the chunk stays unsharded across micro-batches."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = not pp_enabled
    inner = chunk.get_submodule("model")
    head: Any = getattr(chunk, "lm_head", None)
    embed: Any = getattr(inner, "embed_tokens", None)
    # A head tied to the embedding (tie_word_embeddings) shares one parameter, which
    # FSDP2 manages in one unit only: embedding, norm and head go together, unsharded
    # from the forward's start to its end (torchtitan's weight-tying models do so).
    tied = head is not None and embed is not None and head.weight is embed.weight
    if embed is not None and not tied:
        fully_shard(embed, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    for layer in decoder_layers(chunk):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    if hasattr(inner, "norm"):
        norm = inner.get_submodule("norm")
        fully_shard(
            [embed, norm, head] if tied else [norm, head],
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=False,
        )
    fully_shard(chunk, mesh=dp_mesh, mp_policy=mp)
