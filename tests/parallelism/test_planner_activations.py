"""The per-layer activation term of the memory model equals, byte for byte, what
autograd saves for the Hugging Face Llama this repo trains, in fp32, in bf16
(bf16 is where the RMSNorm's fp32 upcast matters) and in bf16 autocast over fp32
weights (the trainer's bf16 without FSDP). Counted with saved-tensor hooks: one
decoder layer is the difference between a 2-layer and a 1-layer model."""

from __future__ import annotations

import pytest
import torch

from stages.model.lm import build_model, causal_lm_loss
from stages.parallelism.memory import WEIGHT_CAST_BYTES, layer_activation_bytes
from stages.presets import ModelPreset


def _saved_bytes(
    preset: ModelPreset, dtype: torch.dtype, batch: int, seq: int, autocast: bool = False
) -> int:
    """Bytes autograd saves in the forward; ``autocast``: fp32 weights under
    ``torch.autocast`` to ``dtype`` (its bf16 weight casts are saved too)."""
    model = build_model(preset)
    if not autocast:
        torch.nn.Module.to(model, dtype)  # the nn.Module method: HF wraps .to oddly for mypy
    model.train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, preset.vocab_size, (batch, seq), generator=generator)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autocast("cpu", dtype=dtype, enabled=autocast),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        causal_lm_loss(model, ids)
    return sum(seen.values())


def _preset(layers: int, h: int, heads: int, kv: int) -> ModelPreset:
    return ModelPreset(
        name=f"act-{layers}-{h}-{heads}-{kv}",
        vocab_size=260,
        hidden_size=h,
        intermediate_size=h * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=256,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("h", "heads", "kv"), [(64, 4, 2), (128, 8, 2), (96, 4, 4)])
def test_layer_activation_bytes_match_autograd_exactly(
    dtype: torch.dtype, h: int, heads: int, kv: int
) -> None:
    batch, seq = 3, 40
    one = _saved_bytes(_preset(1, h, heads, kv), dtype, batch, seq)
    two = _saved_bytes(_preset(2, h, heads, kv), dtype, batch, seq)
    b = torch.tensor([], dtype=dtype).element_size()
    predicted = layer_activation_bytes(_preset(1, h, heads, kv), 1, b, "none")
    assert (two - one) / (batch * seq) == pytest.approx(predicted, abs=1e-9)


@pytest.mark.parametrize(("h", "heads", "kv"), [(64, 4, 2), (128, 8, 2), (96, 4, 4)])
def test_autocast_layer_activation_and_weight_cast_bytes_match_autograd_exactly(
    h: int, heads: int, kv: int
) -> None:
    """Under autocast a layer also saves the bf16 casts of its linears' weights."""
    batch, seq = 3, 40
    one = _saved_bytes(_preset(1, h, heads, kv), torch.bfloat16, batch, seq, autocast=True)
    two = _saved_bytes(_preset(2, h, heads, kv), torch.bfloat16, batch, seq, autocast=True)
    preset = _preset(1, h, heads, kv)
    attn, mlp = preset.layer_params()
    casts = WEIGHT_CAST_BYTES * (attn + mlp - 2 * h)  # every weight but the two norms'
    predicted = layer_activation_bytes(preset, 1, 2, "none", autocast=True)
    assert (two - one - casts) / (batch * seq) == pytest.approx(predicted, abs=1e-9)
